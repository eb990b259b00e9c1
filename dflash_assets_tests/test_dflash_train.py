"""DFlash training: shards, overfitting on real target features, resume, torchrun/gloo DDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_assets.dflash.model.draft_config import DFlashConfig
from dflash_assets.dflash.model.draft_model import load_target_head
from dflash_assets.dflash.model.masks import sample_anchors
from dflash_assets.dflash.shards.dataset import HiddenStateShards, collate_training_batch
from dflash_assets.dflash.target.layers import default_target_layer_ids
from dflash_assets.dflash.training.checkpoints import CheckpointError, latest_checkpoint, load_checkpoint
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.held_out import evaluate
from dflash_assets.dflash.training.setup import lr_lambda
from dflash_assets.dflash.training.train import train
from dflash_assets_tests.tiny_target import (
    N_FEATS,
    VOCAB,
    make_feature_target,
    tiny_train_config,
    write_rows_shard,
)
from dflash_simulators.overfit_drafter import overfit_config

torch.set_num_threads(2)

CONVERSATIONS = [
    (
        "What is the capital of France?",
        "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes.",
    ),
    (
        "Write a Python function that adds two numbers.",
        "def add(a, b):\n    return a + b\n\nThis function takes two numbers and returns their sum.",
    ),
    (
        "Name three primary colors.",
        "The three primary colors are red, yellow and blue. Mixing them gives other colors.",
    ),
    (
        "How many days are in a week?",
        "There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    ),
]


def build_local_target(out_dir: Path) -> dict:
    """Two shards of real SmolLM2 features (target layers [1, 8, 14, 20, 27]) and its embedding/LM head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    model_dir = ensure_local_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    seqs = []
    for question, answer in CONVERSATIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        full = tok.apply_chat_template(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], tokenize=False
        )
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        ids = ids[: ids.index(end_id, len(prompt_ids)) + 1]  # generated tokens end with <|im_end|>
        seqs.append((ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))))
    # one right-padded batch: causal attention keeps real positions exact
    t = max(len(ids) for ids, _ in seqs)
    batch = torch.tensor([ids + [end_id] * (t - len(ids)) for ids, _ in seqs])
    with torch.no_grad():
        out = target(batch, output_hidden_states=True, logits_to_keep=1)
    rows = []
    for b, (ids, loss_mask) in enumerate(seqs):
        feats = torch.cat([out.hidden_states[i + 1][b, : len(ids)] for i in layer_ids], dim=-1)
        rows.append({"input_ids": ids, "loss_mask": loss_mask, "hidden_states": feats})
    shards = [
        write_rows_shard(out_dir / "part-0.safetensors", rows[:2], [0, 1]),
        write_rows_shard(out_dir / "part-1.safetensors", rows[2:], [2, 3]),
    ]
    embed, head = load_target_head(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "shards": [str(s) for s in shards],
        "rows": rows,
        "embed": embed,
        "head": head,
        "config": config,
        "layer_ids": layer_ids,
        "model_dir": str(model_dir),
    }


@pytest.fixture(scope="module")
def local_target(tmp_path_factory):
    return build_local_target(tmp_path_factory.mktemp("shards"))


def test_shards_roundtrip_split_and_truncation(local_target):
    ds = HiddenStateShards(local_target["shards"], split="all", block_size=4)
    assert len(ds) == 4 and ds.feature_dim == 5 * 576
    row = ds[3]
    src = local_target["rows"][3]
    assert row["input_ids"].tolist() == src["input_ids"]
    assert row["loss_mask"].tolist() == src["loss_mask"]
    assert torch.equal(row["hidden_states"], src["hidden_states"].to(torch.bfloat16))
    train_rows = HiddenStateShards(local_target["shards"], split="train", eval_fraction=0.5, block_size=4)
    eval_rows = HiddenStateShards(local_target["shards"], split="eval", eval_fraction=0.5, block_size=4)
    assert sorted(r.key for r in train_rows.rows + eval_rows.rows) == [f"idx:{i}" for i in range(4)]
    assert not {r.key for r in train_rows.rows} & {r.key for r in eval_rows.rows}
    short = HiddenStateShards(local_target["shards"], split="all", max_length=40, block_size=4)
    assert all(short[i]["input_ids"].shape[0] == 40 for i in range(len(short)))
    # with 20 tokens the loss region (after a ~35-token prompt) is cut away: no anchors, rows dropped
    assert len(HiddenStateShards(local_target["shards"], split="all", max_length=20, block_size=4)) == 0


def test_collate_pads_and_masks(local_target):
    ds = HiddenStateShards(local_target["shards"], split="all", block_size=4)
    samples = [ds[0], ds[2]]
    anchors = [sample_anchors(s["loss_mask"], 4, 5, torch.Generator().manual_seed(0)) for s in samples]
    anchors[1] = anchors[1][:2]
    batch = collate_training_batch(samples, anchors, 4, 16)
    c = max(int(a.max()) for a in anchors)
    assert batch.context_hidden.shape == (2, c, 5 * 576)
    assert batch.block_input_ids.shape == (2, 20) and batch.attention_mask.shape == (2, 1, 20, c + 20)
    assert batch.label_mask[1, 8:].sum() == 0  # padding blocks carry no loss
    assert batch.num_block_tokens == (5 + 2) * 4
    a = int(anchors[0][0])
    assert batch.labels[0, :4].tolist() == samples[0]["input_ids"][a : a + 4].tolist()


def _tiny_drafter_config(local_target, layers=1, block_size=4, intermediate=512) -> DFlashConfig:
    return DFlashConfig.from_target_config(
        local_target["config"],
        mask_token_id=16,
        num_hidden_layers=layers,
        block_size=block_size,
        intermediate_size=intermediate,
    )


def test_overfit_real_features_reaches_high_accuracy(local_target, tmp_path):
    """A 1-layer drafter (hidden 576) memorises 2 real sequences: held-in accuracy of positions 1..3 > 0.9."""
    shards = local_target["shards"][:1]  # 2 conversations

    def stop_when_fit(rec):  # the in-loop accuracy is measured before each update
        return all(a >= 0.97 for a in rec["acc_per_position"][1:4])

    cfg = overfit_config(shards, tmp_path / "run", block_size=4, batch_size=2, steps=150, lr=1.5e-3)
    result = train(
        cfg,
        draft_config=_tiny_drafter_config(local_target),
        target_head=(local_target["embed"], local_target["head"]),
        progress_callback=stop_when_fit,
    )
    ev = evaluate(result.model, HiddenStateShards(shards, split="train", block_size=4), max_anchors=64, batch_size=2)
    acc = ev["acc_per_position"]
    assert all(a > 0.9 for a in acc[1:4]), (acc, result.records[-1])
    assert result.records[-1]["loss"] < result.records[0]["loss"] / 10
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(5, result.step + 1, 5))
    assert result.summary["stopped_early"] == (result.step < 150)
    assert latest_checkpoint(tmp_path / "run").name == f"step_{result.step:08d}.pt"
    assert result.tokens_per_s > 0


# ------------------------------------------------------------------------------------------
# tiny synthetic target (tiny_target.make_feature_target) for the fast resume / DDP tests


class Crash(RuntimeError):
    pass


def test_kill_and_resume_reproduces_uninterrupted_curve(tmp_path):
    target, shards = make_feature_target(tmp_path)
    full = train(tiny_train_config(target, shards, tmp_path / "full"))
    full_losses = [r["loss"] for r in full.records]
    assert len(full_losses) == 12

    def crash_at_8(rec):
        if rec["step"] == 8:
            raise Crash()

    out = tmp_path / "resumed"
    with pytest.raises(Crash):
        train(tiny_train_config(target, shards, out), progress_callback=crash_at_8)
    assert latest_checkpoint(out).name == "step_00000006.pt"  # steps 7-8 ran after the last checkpoint
    resumed = train(tiny_train_config(target, shards, out))
    assert resumed.summary["resumed_from_step"] == 6
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))  # steps 7-8 logged once, not twice
    for a, b in zip(full_losses, [r["loss"] for r in log]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (full_losses, [r["loss"] for r in log])
    assert full.summary["rank_param_checksums"] == resumed.summary["rank_param_checksums"]
    assert len(list((out / "checkpoints").glob("step_*.pt"))) == 2  # keep_checkpoints
    assert full_losses[-1] < full_losses[0]


class RunsCode:
    """Pickles as a call that writes a marker file: what a hostile checkpoint on a shared disk holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('the checkpoint ran code')",))


def _point_latest(out: Path, name: str) -> None:
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"file": name, "step": 3}))


def test_resume_never_runs_code_from_a_checkpoint_nor_loads_one_outside_the_run(tmp_path):
    """Issue 27: resume did torch.load(weights_only=False) of the file latest.json named. A pickle that
    runs code is refused unexecuted; latest.json naming a file outside checkpoints/ (a path, or a
    symlink) is refused; a checkpoint written before the change (numpy RNG state) still resumes."""
    target, shards = make_feature_target(tmp_path)
    marker = tmp_path / "marker"
    out = tmp_path / "hostile"
    _point_latest(out, "step_00000003.pt")
    torch.save({"step": 3, "model": RunsCode(marker)}, out / "checkpoints" / "step_00000003.pt")
    with pytest.raises(CheckpointError) as err:
        train(tiny_train_config(target, shards, out, max_steps=3))
    assert "step_00000003.pt: not loaded, it refers to exec" in str(err.value)
    assert "nothing in it ran" in str(err.value) and not marker.exists()

    good = tmp_path / "good"
    train(tiny_train_config(target, shards, good, max_steps=3))  # a real checkpoint at step 3, outside the next run
    outside = good / "checkpoints" / "step_00000003.pt"
    for name in ("../../good/checkpoints/step_00000003.pt", str(outside), "step_3.pt"):
        away = tmp_path / f"away-{len(name)}"
        _point_latest(away, name)
        with pytest.raises(CheckpointError, match="is not a checkpoint name"):
            latest_checkpoint(away)
    linked = tmp_path / "linked"
    _point_latest(linked, "step_00000003.pt")
    (linked / "checkpoints" / "step_00000003.pt").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside"):
        train(tiny_train_config(target, shards, linked, max_steps=3))

    # a checkpoint as written before issue 27 (np.random.get_state() pickled as an ndarray) still resumes
    import numpy as np

    old = tmp_path / "old"
    with pytest.raises(Crash):
        train(tiny_train_config(target, shards, old, max_steps=6), progress_callback=lambda r: _crash_after(r, 4))
    path = latest_checkpoint(old)
    state = torch.load(path, weights_only=True)
    n = state["rng"]["numpy"]
    state["rng"]["numpy"] = (
        n["kind"],
        n["keys"].numpy().astype(np.uint32),
        n["pos"],
        n["has_gauss"],
        n["cached_gaussian"],
    )
    torch.save(state, path)
    assert load_checkpoint(path)["step"] == 3
    assert train(tiny_train_config(target, shards, old, max_steps=6)).summary["resumed_from_step"] == 3


def _crash_after(rec: dict, step: int) -> None:
    if rec["step"] == step:
        raise Crash()


def _cli_args(target: Path, shards: list[str], out: Path, steps: int) -> list[str]:
    return [
        "--shards",
        *shards,
        "--out",
        str(out),
        "--target-model",
        str(target),
        "--num-hidden-layers",
        "2",
        "--block-size",
        "4",
        "--mask-token-id",
        str(VOCAB - 1),
        "--max-anchors",
        "6",
        "--batch-size",
        "2",
        "--lr",
        "1e-2",
        "--max-steps",
        str(steps),
        "--checkpoint-every",
        "10",
        "--eval-fraction",
        "0",
        "--log-every",
        "1",
        "--seed",
        "7",
        "--device",
        "cpu",
        "--draft-overrides",
        "{}",
        "--config-json",
        str(_write_json(out.parent / f"{out.name}.json", {"num_context_features": N_FEATS})),
    ]


def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    """A real SIGKILL at an arbitrary moment: the rerun resumes from the last complete checkpoint and
    the final log equals an uninterrupted run's, step for step."""
    import signal
    import time

    target, shards = make_feature_target(tmp_path)
    steps = 200
    out = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "dflash_assets.dflash.training.train", *_cli_args(target, shards, out, steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    log_path = out / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if log_path.is_file() and log_path.read_text().count("\n") >= 35:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "run finished before it could be killed: " + proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and int(ckpt.stem.split("_")[1]) < steps
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 30 <= summary["resumed_from_step"] < steps
    killed_log = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["step"] for r in killed_log] == list(range(1, steps + 1))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same reduction order as the subprocesses
    try:
        full = train(tiny_train_config(target, shards, tmp_path / "full", max_steps=steps, checkpoint_every=0))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip([r["loss"] for r in full.records], [r["loss"] for r in killed_log]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))
    assert full.summary["rank_param_checksums"] == summary["rank_param_checksums"]


def test_shard_metadata_target_layer_ids_are_used_and_checked(tmp_path):
    target, shards = make_feature_target(tmp_path)
    rows = [HiddenStateShards([sh], split="all", block_size=4)[0] for sh in shards]
    tagged = [str(write_rows_shard(tmp_path / "tagged.safetensors", rows, [0, 1], {"target_layer_ids": "[1, 2, 6]"}))]
    result = train(tiny_train_config(target, tagged, tmp_path / "ok", max_steps=1))
    assert result.model.config.target_layer_ids == [1, 2, 6]  # from the shards, not the default [1, 3, 5]
    with pytest.raises(ValueError, match="target layers"):
        train(tiny_train_config(target, tagged, tmp_path / "bad", max_steps=1, target_layer_ids=[1, 3, 5]))
    other = str(write_rows_shard(tmp_path / "other.safetensors", rows, [2, 3], {"target_layer_ids": "[1, 3, 5]"}))
    with pytest.raises(ValueError, match="target_layer_ids"):
        HiddenStateShards([*tagged, other], split="all", block_size=4)


def test_lr_schedule_warmup_and_cosine():
    f = lr_lambda(100, 0.04)
    assert [round(f(s), 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert abs(f(52) - 0.5) < 1e-9  # halfway through the cosine part (steps 4..100)
    assert f(100) == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_gloo_identical_weights(tmp_path):
    target, shards = make_feature_target(tmp_path)
    out = tmp_path / "ddp"
    export_dir = tmp_path / "export"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "dflash_assets.dflash.training.train",
        "--shards",
        *shards,
        "--out",
        str(out),
        "--target-model",
        str(target),
        "--num-hidden-layers",
        "2",
        "--block-size",
        "4",
        "--mask-token-id",
        str(VOCAB - 1),
        "--max-anchors",
        "6",
        "--batch-size",
        "1",
        "--lr",
        "1e-2",
        "--max-steps",
        "6",
        "--checkpoint-every",
        "3",
        "--seed",
        "3",
        "--device",
        "cpu",
        "--config-json",
        str(_write_json(tmp_path / "extra.json", {"num_context_features": N_FEATS})),
        "--export",
        str(export_dir),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    sums = summary["rank_param_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    # each step consumed 2 rows (one per rank): block tokens of both ranks are counted
    assert all(r["block_tokens"] == 2 * 6 * 4 for r in log)
    assert (export_dir / "model.safetensors").is_file()


def _write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_drafter_with_its_own_attention_shape_trains_exports_reloads_and_decodes(tmp_path):
    """Heads, KV heads, head_dim and MLP width unlike the target's (as the published Qwen3.6 recipe's 32 / 8 /
    128 against the target's 24 / 4 / 256): a step trains, the export says the shape in the fields SGLang and
    vLLM read, the reload is tensor for tensor the trained model, and it decodes losslessly."""
    from tiny_target import LAYER_IDS, make_rows, make_target
    from tiny_target import VOCAB as TV

    from dflash_assets.dflash.decoding.speculative import dflash_generate, target_generate
    from dflash_assets.dflash.export.directory import export_drafter, load_exported
    from dflash_assets.dflash.shards.extraction import extract_partition
    from dflash_assets.dflash.shards.format import read_index

    model, target_dir = make_target(tmp_path)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (4, 2, 8)
    rows = make_rows(6)
    extract_partition(model, rows, tmp_path / "hs", LAYER_IDS, rows_per_shard=8, max_tokens_per_batch=256)
    shards = [str(tmp_path / "hs" / s["name"]) for s in read_index(tmp_path / "hs")["shards"]]
    shape = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 6, "intermediate_size": 40}
    cfg = TrainConfig(
        shards=shards,
        out_dir=str(tmp_path / "run"),
        target_model_path=str(target_dir),
        num_hidden_layers=1,
        num_context_features=3,
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=TV - 1,
        draft_overrides=shape,
        max_anchors=4,
        batch_size=2,
        max_steps=2,
        checkpoint_every=0,
        eval_fraction=0.0,
        device="cpu",
    )
    result = train(cfg)
    trained = result.model.eval()
    assert {k: getattr(trained.config, k) for k in shape} == shape and result.step == 2
    attn = trained.layers[0].self_attn
    assert (
        attn.q_proj.weight.shape == (48, 32)
        and attn.k_proj.weight.shape == (24, 32)
        and attn.o_proj.weight.shape == (32, 48)
    )
    out = export_drafter(trained, tmp_path / "export", dtype=torch.float32)
    exported = json.loads((out / "config.json").read_text())
    assert {k: exported[k] for k in shape} == shape and exported["hidden_size"] == 32
    assert exported["dflash_config"] == {"mask_token_id": TV - 1, "target_layer_ids": LAYER_IDS, "block_size": 4}
    embed, head = model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()
    loaded = load_exported(out, embed_weight=embed, lm_head_weight=head).eval()
    theirs, ours = loaded.state_dict(), trained.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    for prompt in ([5, 9, 13, 2, 40, 41], [70, 3, 3, 8]):
        plain = target_generate(model, prompt, 12)
        spec = dflash_generate(model, loaded, prompt, 12)
        assert spec.output_ids == plain.output_ids and spec.num_draft_forwards > 0
