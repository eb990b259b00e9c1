"""The main job end to end on the Qwen3.6-architecture stand-in (``configs/local_qwen36_hybrid.yaml``, reduced).

One ``python -m dflash_assets run`` in a fresh process, DAGSTER_HOME and storage: completions from a real
``transformers serve`` serving the ``Qwen3_5ForConditionalGeneration`` stand-in, then every stage. Checked
against values computed here independently: the thinking/answer split at ``</think>``, the loss mask starting
right after the generation prompt (which ends ``<think>\\n``), the stored hidden states equal to the wrapper's
decoder (``model.language_model``) outputs at the resolved layers, the export's target layer count, and a
lossless evaluation (the trained drafter alone: the default runs no untrained one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import torch
import yaml

from dflash_assets.common.config import BUNDLED

ROOT = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 2, 3, 4, 5]  # the default rule over 8 decoder layers


def reduced_config(tmp_path: Path) -> Path:
    """The bundled config with fewer prompts, a lower cap, fewer steps and a shorter evaluation."""
    config = yaml.safe_load((BUNDLED / "local_qwen36_hybrid.yaml").read_text())
    ops, resources = config["ops"], config["resources"]
    resources["generation"]["max_output_tokens"] = 128
    ops["prompt_corpus"]["config"].update(max_prompts=10, partition_size=10)
    ops["hidden_states"]["config"]["rows_per_shard"] = 10
    ops["dflash_drafter"]["config"].update(max_steps=30, checkpoint_every=0, eval_fraction=0.3)
    ops["drafter_evaluation"]["config"].update(num_prompts=2, max_new_tokens=16, teacher_forced_anchors=8)
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_main_job_on_the_hybrid_standin(tmp_path):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from dflash_assets.dflash.shards.format import read_shard
    from dflash_assets.generation.engines.hybrid_standin import ensure_hybrid_standin

    data = tmp_path / "data"
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "DFLASH_STORAGE_ROOT": str(data),
        "OMP_NUM_THREADS": "1",
        "DFLASH_PROGRESS_BAR": "1",  # the bars a terminal would show (test_progress checks the terminal rule)
    }
    (tmp_path / "home").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(reduced_config(tmp_path))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "lossless: yes" in out
    # long stages drew their progress bars: absolute position of the total, with rate and figures
    rows = r"completions 0000000-0000009\.\.\.0000000-0000009: 100%\|.*\| 10/10 \[.*(row/s|s/row), failed=0, out_tok/s="
    assert re.search(rows, out), out[-4000:]
    assert re.search(r"hidden_states 0000000-0000009: 100%\|.*\| 1/1 \[.*(shard/s|s/shard), tok/s=\d+\]", out), out[
        -4000:
    ]
    assert re.search(r"dflash_drafter training: 100%\|.*\| 30/30 \[.*(step/s|s/step), loss=[\d.]+, tok/s=\d+\]", out), (
        out[-4000:]
    )
    # one decoding per held-out prompt: the default evaluation runs no untrained drafter (untrained_baseline)
    assert re.search(r"drafter_evaluation heldout: 100%\|.*\| 2/2 \[.*(prompt/s|s/prompt), tok/s=[\d.]+\]", out), out[
        -4000:
    ]

    standin = ensure_hybrid_standin()
    tokenizer = AutoTokenizer.from_pretrained(standin)
    close, end = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.convert_tokens_to_ids("<|im_end|>")

    # completions: thinking and answer split at </think> by the server's parser, most rows finished
    completions = pl.concat([pl.read_parquet(p) for p in sorted((data / "completions").glob("*.parquet"))])
    stop = completions.filter(pl.col("finish_reason") == "stop")
    assert stop.height >= completions.height // 2
    assert all(r and a for r, a in zip(stop["reasoning_content"], stop["content"]))
    assert not any("</think>" in (a or "") for a in completions["content"])

    # tokenized: prompt = the template's generation prompt (ending "<think>\n"), loss from the next token on
    corpus = pl.read_parquet(data / "prompt_corpus" / "corpus.parquet")
    messages = dict(zip(corpus["index"].to_list(), corpus["messages"].to_list()))
    tokenized = pl.concat(
        [
            pl.read_parquet(p)
            for p in sorted((data / "tokenized_sequences").glob("0*.parquet"))
            if not p.name.endswith(".set_aside.parquet")
        ]
    )
    opener = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    for row in tokenized.iter_rows(named=True):
        prompt = tokenizer.apply_chat_template(messages[row["index"]], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        n = row["prompt_len"]
        assert n == len(prompt_ids) and row["input_ids"][:n] == prompt_ids and prompt_ids[-len(opener) :] == opener
        assert row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        if row["finish_reason"] == "stop":
            completion = row["input_ids"][n:]
            assert completion.count(close) == 1 and completion[-1] == end and completion.index(close) > 0

    # hidden states: the wrapper's decoder outputs at the resolved layers, recomputed here
    shards = sorted((data / "hidden_states").rglob("shard-*.safetensors"))
    shard = read_shard(shards[0])
    assert shard.target_layer_ids == LAYER_IDS
    wrapper = Qwen3_5ForConditionalGeneration.from_pretrained(standin, dtype=torch.float32).eval()
    row = shard.row(0)
    with torch.no_grad():
        decoder = wrapper.model.language_model
        states = decoder(input_ids=row["input_ids"][None].long(), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i + 1][0] for i in LAYER_IDS], dim=-1).to(row["hidden_states"].dtype)
    torch.testing.assert_close(row["hidden_states"].float(), expected.float(), atol=2e-2, rtol=2e-2)

    # export: a drafter for an 8-layer hybrid target, at the same layers
    export = json.loads((data / "dflash_drafter" / "export" / "config.json").read_text())
    assert export["num_target_layers"] == 8 and export["dflash_config"]["target_layer_ids"] == LAYER_IDS

    # evaluation: greedy speculative decoding equal to plain decoding on the hybrid target
    report = json.loads((data / "drafter_evaluation" / "report.json").read_text())
    heldout = report["datasets"]["heldout"]
    assert heldout["trained"]["lossless"] is True and "untrained" not in heldout
    assert "untrained" not in report["teacher_forced_chain"] and "untrained drafter" not in out
    assert heldout["trained"]["new_tokens"] > 0
    # tau on tool-call turns apart: the stand-in's text is not language, so none of its prompts calls a tool
    turns = report["tool_call_turns"]["heldout"]
    assert turns["tool_call"]["prompts"] == 0 and turns["other"]["prompts"] == len(heldout["trained"]["per_prompt_tau"])
    assert abs(turns["other"]["tau_in_process"] - heldout["trained"]["tau"]) < 1e-3
