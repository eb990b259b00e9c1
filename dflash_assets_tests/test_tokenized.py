"""tokenized_sequences: input_ids / loss_mask rebuilt independently on real server completions, thinking
templates, the blocking checks stopping hidden_states, and the row policies' counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import torch
from transformers import AutoTokenizer

from dflash_assets.assets.completions import completions
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.tokenization import SequenceBuilder, TokenizePolicy, tokenize_partition
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration.check_gate import CHECK_DEGENERATE
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.thinking_tokenizer import write_thinking_tokenizer

END = "<|im_end|>"
CAP = 32
# short questions SmolLM2 answers within the cap (stop rows) and open tasks it cannot finish (length rows)
SERVED_PROMPTS = [
    "Say hello.",
    "What is 2+2? Reply with just the number.",
    "Name a color.",
    "Write a haiku about the sea.",
    "Translate 'good morning' to French.",
    "Write a long essay about the history of Rome.",
    "List three fruits.",
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Explain recursion in detail with several examples.",
    "Say goodbye.",
    "What is 10 times 3?",
]
SERVED_PK = f"0000000-{len(SERVED_PROMPTS) - 1:07d}"


@pytest.fixture(scope="module")
def smol_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_local_model())


def _checks(result) -> dict[str, bool]:
    return {
        e.event_specific_data.check_name: e.event_specific_data.passed
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }


# ------------------------------------------------------------------------------------------------
# 1. real completions from the local server


@pytest.fixture(scope="module")
def served(local_inference, tmp_path_factory):
    """Corpus -> completions (cap 32, real server) -> tokenized_sequences (truncated=keep) in one partition."""
    root = tmp_path_factory.mktemp("served")
    source = root / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": p}) for p in SERVED_PROMPTS))
    resources = {
        "storage": StorageResource(root=str(root)),
        "inference": local_inference,
        "generation": GenerationResource(max_output_tokens=CAP),
        "target_model": TargetModelResource(),
    }
    with dg.instance_for_test() as instance:
        corpus_config = {"sources": [str(source)], "partition_size": len(SERVED_PROMPTS)}
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources=resources,
            run_config={"ops": {"prompt_corpus": {"config": corpus_config}}},
        ).success
        result = dg.materialize(
            [completions, tokenized_sequences],
            instance=instance,
            resources=resources,
            partition_key=SERVED_PK,
            raise_on_error=False,
            run_config={"ops": {"tokenized_sequences": {"config": {"truncated": "keep"}}}},
        )
    assert result.success
    return {
        "checks": _checks(result),
        "corpus": pl.read_parquet(root.joinpath(*CORPUS_FILE)),
        "completions": pl.read_parquet(root / "completions" / f"{SERVED_PK}.parquet"),
        "tokenized": pl.read_parquet(root / "tokenized_sequences" / f"{SERVED_PK}.parquet"),
    }


def test_served_completions_rebuild_independently(served, smol_tokenizer):
    tok = smol_tokenizer
    end_id = tok.convert_tokens_to_ids(END)
    messages = dict(zip(served["corpus"]["index"].to_list(), served["corpus"]["messages"].to_list()))
    rows = {r["index"]: r for r in served["completions"].iter_rows(named=True)}
    tokenized = served["tokenized"]
    reasons = [r["finish_reason"] for r in rows.values()]
    assert all(r["error"] is None for r in rows.values())
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 1, reasons  # both kinds are exercised
    assert tokenized["index"].to_list() == sorted(rows)  # truncated=keep: every row kept
    blocking = {k: v for k, v in served["checks"].items() if k != "retokenized_length_matches_server"}
    assert all(blocking.values()) and len(blocking) == 4
    # the warn-only check flags exactly the rows whose re-tokenized length differs from the server's count
    differ = sorted(
        t["index"]
        for t in tokenized.iter_rows(named=True)
        if t["num_loss_tokens"] != rows[t["index"]]["completion_tokens"]
    )
    assert served["checks"]["retokenized_length_matches_server"] == (not differ)

    for t in tokenized.iter_rows(named=True):
        row = rows[t["index"]]
        # the simplest direct calls: template ids for the prompt, plain encode for the reply, + <|im_end|> on stop
        prompt_ids = tok.apply_chat_template(messages[t["index"]], add_generation_prompt=True, return_dict=False)
        completion_ids = tok.encode(row["content"], add_special_tokens=False)
        if row["finish_reason"] == "stop":
            completion_ids.append(end_id)
        assert t["input_ids"] == prompt_ids + completion_ids, t["index"]
        assert t["loss_mask"] == [0] * len(prompt_ids) + [1] * len(completion_ids)
        assert t["prompt_len"] == len(prompt_ids) == row["prompt_tokens"]  # the server's usage.prompt_tokens
        assert t["num_loss_tokens"] == len(completion_ids)
        if row["finish_reason"] == "stop":
            assert t["input_ids"][-1] == end_id
            # usage.completion_tokens counts the <|im_end|> the server stopped on
            assert t["num_loss_tokens"] == row["completion_tokens"], (t["index"], row["content"])
        else:
            # a length row: no end token; re-tokenizing the text can split whitespace differently from what
            # the model emitted (e.g. "\n\n" as one token vs two), which the warn-only check above reports
            assert t["input_ids"][-1] != end_id and row["completion_tokens"] == CAP


# ------------------------------------------------------------------------------------------------
# 2. a thinking template (Qwen3 layout)


def thinking_tokenizer(tmp_path: Path, opens_think: bool):
    """SmolLM2's tokenizer with thinking markers (:func:`write_thinking_tokenizer`), loaded."""
    return AutoTokenizer.from_pretrained(write_thinking_tokenizer(tmp_path, opens_think))


def completion_row(
    index: int,
    content: str | None,
    finish_reason: str = "stop",
    reasoning: str | None = None,
    enable_thinking: bool = True,
    truncated_in_reasoning: bool = False,
    error: str | None = None,
    completion_tokens: int = 10,
) -> dict:
    settings = GenerationSettings(max_output_tokens=64, enable_thinking=enable_thinking)
    return {
        "index": index,
        "prompt_id": f"t:{index}",
        "prompt_hash": f"h{index}",
        "source": "t",
        "reasoning_content": reasoning,
        "content": content,
        "finish_reason": finish_reason,
        "prompt_tokens": 10,
        "completion_tokens": completion_tokens,
        "output_token_ids": None,
        "truncated_in_reasoning": truncated_in_reasoning,
        "empty_answer": not (content or "").strip(),
        "max_output_tokens": 64,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": json.dumps(settings.model_dump(), sort_keys=True),
        "latency_s": 0.1,
        "server": "test",
        "attempts": 1,
        "error": error,
    }


def corpus_frame(questions: dict[int, str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "index": list(questions),
            "prompt_id": [f"t:{i}" for i in questions],
            "source": ["t"] * len(questions),
            "messages": [[{"role": "user", "content": q}] for q in questions.values()],
            "content_hash": [f"h{i}" for i in questions],  # completion_row's prompt_hash: the rows answer these prompts
        }
    )


@pytest.mark.parametrize("opens_think", [False, True], ids=["qwen3_prompt_without_think", "prompt_ends_with_think"])
def test_thinking_masks_cover_generated_reasoning_markers_and_answer(tmp_path, opens_think):
    tok = thinking_tokenizer(tmp_path, opens_think)
    think_open, think_close, end_id = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", END))
    questions = {0: "What is 2+3?", 1: "Count to ten.", 2: "Say hi.", 3: "Say bye."}
    rows = rows_to_frame(
        [
            completion_row(0, "5", reasoning="Let me add 2 and 3. That is 5."),
            completion_row(1, "", "length", reasoning="First, consider the", truncated_in_reasoning=True),
            completion_row(2, "Hi there.", enable_thinking=False),
            completion_row(3, "Bye.", reasoning="should not be here", enable_thinking=False),
        ]
    )
    out, aside, counts = tokenize_partition(
        rows, corpus_frame(questions), SequenceBuilder(tok), TokenizePolicy(truncated="keep")
    )
    assert dict(counts) == {"kept": 3, "tokenization_errors": 1}
    # reasoning under enable_thinking=false is refused, never guessed into some layout
    assert aside["index"].to_list() == [3] and "enable_thinking=false" in aside["reason"][0]
    by_index = {r["index"]: r for r in out.iter_rows(named=True)}

    def user(q: str) -> str:
        return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"

    gen_open = "" if opens_think else "<think>\n"  # the model generated <think> only when the prompt lacks it
    expected = {  # (prompt text the template renders, text the model generated, ends with <|im_end|>)
        0: (
            user(questions[0]) + ("<think>\n" if opens_think else ""),
            f"{gen_open}Let me add 2 and 3. That is 5.\n</think>\n\n5",
            True,
        ),
        1: (user(questions[1]) + ("<think>\n" if opens_think else ""), f"{gen_open}First, consider the", False),
        2: (user(questions[2]) + "<think>\n\n</think>\n\n", "Hi there.", True),
    }
    for index, (prompt, generated, stops) in expected.items():
        r = by_index[index]
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        generated_ids = tok(generated, add_special_tokens=False)["input_ids"] + ([end_id] if stops else [])
        assert r["input_ids"] == prompt_ids + generated_ids, index
        assert r["loss_mask"] == [0] * len(prompt_ids) + [1] * len(generated_ids), index
        assert tok.decode(r["input_ids"][: r["prompt_len"]]) == prompt
        supervised = [i for i, m in zip(r["input_ids"], r["loss_mask"]) if m]
        assert tok.decode(supervised) == generated + (END if stops else "")
        # template-rendered markers are never supervised; generated ones always are
        prompt_part = r["input_ids"][: r["prompt_len"]]
        assert (think_open in supervised) == (index in (0, 1) and not opens_think)
        assert (think_open in prompt_part) == (index == 2 or (opens_think and index in (0, 1)))
        assert (think_close in supervised) == (index == 0)
    # truncated inside the reasoning: <think> (when generated) + reasoning, no </think>, no end token
    assert by_index[1]["input_ids"][-1] != end_id and by_index[1]["finish_reason"] == "length"


def test_reasoning_without_think_tokens_is_an_error(smol_tokenizer):
    rows = rows_to_frame([completion_row(0, "5", reasoning="2+3 is 5")])
    out, aside, counts = tokenize_partition(
        rows, corpus_frame({0: "What is 2+3?"}), SequenceBuilder(smol_tokenizer), TokenizePolicy()
    )
    assert out.height == 0 and dict(counts) == {"tokenization_errors": 1}
    assert "no <think>/</think> tokens" in aside["reason"][0]


# ------------------------------------------------------------------------------------------------
# 3. the blocking checks and the row policies, through the assets


def write_partition(root: Path, questions: dict[int, str], rows: list[dict]) -> str:
    (root / "prompt_corpus").mkdir(parents=True, exist_ok=True)
    (root / "completions").mkdir(parents=True, exist_ok=True)
    corpus_frame(questions).write_parquet(root.joinpath(*CORPUS_FILE))
    pk = f"{min(questions):07d}-{max(questions):07d}"
    rows_to_frame(rows).write_parquet(root / "completions" / f"{pk}.parquet")
    return pk


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    """A randomly initialised 8-layer Llama (hidden 64) with SmolLM2's tokenizer: hidden_states in a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_target")
    src = ensure_local_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, path / name)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def run_stages(root: Path, pk: str, assets, target: str, tokenize_config: dict | None = None):
    resources = {
        "storage": StorageResource(root=str(root)),
        "target_model": TargetModelResource(model_path=target),
        "generation": GenerationResource(max_output_tokens=64),
    }
    run_config = {"ops": {"tokenized_sequences": {"config": tokenize_config or {}}}}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [pk])
        result = dg.materialize(
            assets,
            instance=instance,
            resources=resources,
            partition_key=pk,
            run_config=run_config,
            raise_on_error=False,
        )
        materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
        hidden_latest = instance.get_latest_materialization_event(dg.AssetKey("hidden_states"))
    return result, materialized, hidden_latest


QUESTIONS = {i: f"Question number {i}: tell me something." for i in range(8)}


def test_empty_answers_block_hidden_states_and_healthy_partition_passes(tmp_path, tiny_target):
    empty = [completion_row(i, "", completion_tokens=1) for i in QUESTIONS]
    pk = write_partition(tmp_path / "empty", QUESTIONS, empty)
    result, materialized, hidden_latest = run_stages(
        tmp_path / "empty", pk, [tokenized_sequences, hidden_states], tiny_target
    )
    checks = _checks(result)
    assert checks[CHECK_DEGENERATE] is False  # every row supervises exactly 1 token (the end token)
    assert not result.success
    assert materialized == {"tokenized_sequences"} and hidden_latest is None
    hidden_step = [e for e in result.all_events if e.step_key == "hidden_states"]
    assert not any(e.event_type_value in ("STEP_START", "STEP_SUCCESS") for e in hidden_step)
    assert not (tmp_path / "empty" / "hidden_states").exists()

    healthy = [completion_row(i, " ".join(["word"] * (3 + 4 * i)) + ".") for i in QUESTIONS]
    pk = write_partition(tmp_path / "healthy", QUESTIONS, healthy)
    result, materialized, hidden_latest = run_stages(
        tmp_path / "healthy", pk, [tokenized_sequences, hidden_states], tiny_target
    )
    checks = _checks(result)
    # blocking checks pass; the warn-only token-count check fails here because these synthetic rows claim 10 tokens
    assert result.success and all(v for k, v in checks.items() if k != "retokenized_length_matches_server")
    assert checks["retokenized_length_matches_server"] is False
    assert materialized == {"tokenized_sequences", "hidden_states"} and hidden_latest is not None
    # extraction must not switch autograd off for the rest of the process (the drafter trains after it
    # in the same process in `python -m dflash_assets run`: it failed with "does not require grad")
    assert torch.is_grad_enabled()
    assert hidden_latest.asset_materialization.metadata["rows"].value == len(QUESTIONS)


def test_row_policies_counted_in_metadata(tmp_path, smol_tokenizer, tiny_target):
    max_length = 128
    long_answer = " ".join(f"item{i}" for i in range(150))
    questions = {i: f"Question {i}?" for i in range(9)}
    questions[8] = "Read this: " + " ".join(f"fact{i}" for i in range(200))  # the prompt alone exceeds max_length
    rows = [
        completion_row(0, "Short answer."),
        completion_row(1, "Another short one, a bit longer."),
        completion_row(2, "Yes."),
        completion_row(3, "Cut off in the mid", "length"),
        completion_row(4, "Also cut", "length"),
        completion_row(5, None, None, error="HTTP 500 after 5 attempts"),
        completion_row(6, long_answer),
        completion_row(7, long_answer + " more"),
        completion_row(8, "Ok."),
    ]
    # independent lengths: which rows exceed max_length
    lengths = {}
    for r in rows:
        if r["error"] is None:
            prompt_ids = smol_tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[r["index"]]}], add_generation_prompt=True, return_dict=False
            )
            reply = smol_tokenizer.encode(r["content"], add_special_tokens=False)
            lengths[r["index"]] = (len(prompt_ids), len(prompt_ids) + len(reply) + (r["finish_reason"] == "stop"))
    assert {i for i, (_, n) in lengths.items() if n > max_length} == {6, 7, 8}
    assert lengths[8][0] > max_length and all(lengths[i][0] < max_length for i in (6, 7))

    pk = write_partition(tmp_path / "drop", questions, rows)
    result, _, _ = run_stages(tmp_path / "drop", pk, [tokenized_sequences], tiny_target, {"max_length": max_length})
    assert result.success
    meta = result.asset_materializations_for_node("tokenized_sequences")[0].metadata
    assert meta["counts"].value == {"kept": 3, "dropped_truncated": 2, "error_rows": 1, "dropped_over_max_length": 3}
    assert meta["rows"].value == 3
    aside = pl.read_parquet(tmp_path / "drop" / "tokenized_sequences" / f"{pk}.set_aside.parquet")
    assert sorted(aside["index"].to_list()) == [3, 4, 5, 6, 7, 8]
    assert aside.filter(pl.col("index") == 5)["reason"][0].startswith("error row: HTTP 500")

    pk = write_partition(tmp_path / "keep", questions, rows)
    result, _, _ = run_stages(
        tmp_path / "keep",
        pk,
        [tokenized_sequences],
        tiny_target,
        {"max_length": max_length, "truncated": "keep", "over_max_length": "cut"},
    )
    assert result.success
    meta = result.asset_materializations_for_node("tokenized_sequences")[0].metadata
    # row 8 cannot be cut: its prompt alone is longer than max_length
    assert meta["counts"].value == {"kept": 7, "cut": 2, "error_rows": 1, "dropped_over_max_length": 1}
    out = pl.read_parquet(tmp_path / "keep" / "tokenized_sequences" / f"{pk}.parquet")
    assert out["index"].to_list() == [0, 1, 2, 3, 4, 6, 7]
    for r in out.iter_rows(named=True):
        prompt_len, total = lengths[r["index"]]
        assert r["prompt_len"] == prompt_len
        assert r["cut"] == (r["index"] in (6, 7))
        assert len(r["input_ids"]) == len(r["loss_mask"]) == min(total, max_length)
        assert r["num_loss_tokens"] == min(total, max_length) - prompt_len


def test_server_token_ids_are_used_as_returned(smol_tokenizer):
    """SGLang returns the generated ids: they are taken verbatim (no re-tokenization), mixed in one batch
    with rows that are re-tokenized; <|im_end|> is appended to stop rows only when missing."""
    tok = smol_tokenizer
    end_id = tok.convert_tokens_to_ids(END)
    odd = tok.encode("Hel", add_special_tokens=False) + tok.encode("lo", add_special_tokens=False)  # not canonical
    assert odd != tok.encode("Hello", add_special_tokens=False)
    rows = [
        completion_row(0, "Hello"),
        completion_row(1, "Hello"),
        completion_row(2, "Hello"),
        completion_row(3, "Hello", "length"),
    ]
    rows[0]["output_token_ids"] = odd
    rows[2]["output_token_ids"] = [*odd, end_id]
    rows[3]["output_token_ids"] = odd
    questions = {i: f"Say hello {i}." for i in range(4)}
    out, _, counts = tokenize_partition(
        rows_to_frame(rows), corpus_frame(questions), SequenceBuilder(tok), TokenizePolicy(truncated="keep")
    )
    assert counts["kept"] == 4
    expected_tail = {
        0: [*odd, end_id],
        1: [*tok.encode("Hello", add_special_tokens=False), end_id],
        2: [*odd, end_id],
        3: odd,
    }
    for r in out.iter_rows(named=True):
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": questions[r["index"]]}], add_generation_prompt=True, return_dict=False
        )
        assert r["input_ids"] == prompt_ids + expected_tail[r["index"]]
        assert r["loss_mask"] == [0] * len(prompt_ids) + [1] * len(expected_tail[r["index"]])


def test_gpu_config_cuts_long_thinking_rows_instead_of_setting_them_aside(tmp_path):
    """gpu_qwen36_27b.yaml's tokenized settings (the published recipe: cut at 4,096): rows far longer than
    that, finished or cut by the generation cap inside the thinking, are all kept, cut at 4,096 with their
    supervised tokens intact, and the drafter's training rows keep every one of them."""
    import yaml

    from dflash_assets.common.config import BUNDLED
    from dflash_assets.dflash.training.online import TokenizedRows
    from dflash_assets.stages.drafter.config import DrafterConfig
    from dflash_assets.stages.tokenized import TokenizeConfig

    ops = yaml.safe_load((BUNDLED / "gpu_qwen36_27b.yaml").read_text())["ops"]
    settings = TokenizeConfig(**ops["tokenized_sequences"]["config"])
    drafter = DrafterConfig(**ops["dflash_drafter"]["config"])
    assert (settings.max_length, settings.over_max_length, settings.truncated) == (4096, "cut", "keep")
    assert drafter.max_length == settings.max_length
    tok = thinking_tokenizer(tmp_path, opens_think=True)
    long_text = " ".join(f"step {i} of the plan" for i in range(1500))  # > 4,096 tokens
    questions = {i: f"Hard task number {i}." for i in range(5)}
    rows = rows_to_frame(
        [
            completion_row(0, "Done.", reasoning=long_text),  # finished, longer than max_length
            completion_row(1, "", "length", reasoning=long_text, truncated_in_reasoning=True),  # cut by the cap
            completion_row(2, "", "length", reasoning=long_text + " and more", truncated_in_reasoning=True),
            completion_row(3, "Short, but with room for a block of 16.", reasoning="An easy one. " * 8),
            completion_row(4, long_text, "length", reasoning="Thought."),  # cut by the cap in the answer
        ]
    )
    policy = TokenizePolicy(settings.max_length, settings.truncated, settings.over_max_length)
    out, aside, counts = tokenize_partition(rows, corpus_frame(questions), SequenceBuilder(tok), policy)
    assert aside.height == 0, aside.to_dicts()  # no row set aside, for length or anything else
    assert out["index"].to_list() == [0, 1, 2, 3, 4]
    assert counts["cut"] == 4 and counts["kept"] == 5
    lengths = out["input_ids"].list.len().to_list()
    assert lengths[:3] == [4096] * 3 and lengths[4] == 4096 and lengths[3] < 4096
    for r in out.iter_rows(named=True):  # the cut keeps the prefix: prompt unsupervised, the rest supervised
        assert r["loss_mask"] == [0] * r["prompt_len"] + [1] * (len(r["input_ids"]) - r["prompt_len"])
    train_rows = TokenizedRows(
        [
            {"index": r["index"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            for r in out.iter_rows(named=True)
        ],
        max_length=drafter.max_length,
        block_size=drafter.block_size,
    )
    assert len(train_rows) == 5 and train_rows.dropped_rows == 0
    assert train_rows.num_tokens == sum(lengths)
    # the settings this replaced (3,072, drop, drop) set all but the short row aside
    _, old_aside, _ = tokenize_partition(
        rows, corpus_frame(questions), SequenceBuilder(tok), TokenizePolicy(3072, "drop", "drop")
    )
    assert sorted(old_aside["index"].to_list()) == [0, 1, 2, 4]
