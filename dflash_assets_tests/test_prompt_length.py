"""Issue 38 item 3: each prompt's templated length is known before it is sent.

Against :class:`~dflash_simulators.stand_in_server.FakeServer` (external mode, SmolLM2's tokenizer, a context
of :data:`CONTEXT` tokens): prompts with no room for the cap are set aside as ``prompt_too_long`` rows and never
reach the server; a server that still refuses prompts as too long for its context (HTTP 400, SGLang's and
vLLM's words) costs those rows only, more of them in a row than ``max_consecutive_failures`` included; a lower
cap gives set-aside prompts room and they are requested, a longer context likewise. Lengths are counted here
independently, by the tokenizer's own ``apply_chat_template(..., tokenize=True)``.
"""

from __future__ import annotations

import json

import dagster as dg
import numpy as np
import polars as pl

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.truncation import cap_advice, row_counts
from dflash_assets.generation.client.attempts import CONTEXT_REFUSED
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG, TOO_LONG_CAP, TOO_LONG_CONTEXT, invalid_reason
from dflash_assets.orchestration.freshness import settings_reason
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.behaviours import Error, Reply
from dflash_simulators.counting_proxy import last_user_message
from dflash_simulators.stand_in_server import FakeServer

CONTEXT = 200
CAP = 64
SHORT = [f"Short question number {i}?" for i in range(4)]
# ~190 and ~260 templated tokens: no room for the cap under 200 either way; the first fits a cap of 8
LONG = ["word " * 150 + "end?", "word " * 220 + "end?"]
# what the server refuses although this project counts them as fitting (its count or context differs)
REFUSED = [f"Refused prompt {i}?" for i in range(5)]
SGLANG_400 = (
    "Requested token count exceeds the model's maximum context length of 200 tokens. You requested a total of "
    "230 tokens: 166 tokens from the input messages and 64 tokens for the completion."
)
VLLM_400 = "This model's maximum context length is 200 tokens. However, your prompt contains 220 input tokens."


def templated_length(tokenizer, prompt: str) -> int:
    """The prompt's length as a server counts it, computed apart from the project's code path."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def script(n, body):
    text = last_user_message(body)
    if text in REFUSED:
        return Error(400, SGLANG_400 if REFUSED.index(text) % 2 else VLLM_400)
    return Reply(content="An answer.", reasoning=None, completion_tokens=5, prompt_tokens=20)


def run_completions(instance, root, server_url, pk, *, cap=CAP, context=CONTEXT, failures=3):
    inference = InferenceServerResource(
        mode="external",
        external={
            "base_urls": [server_url],
            "served_model_name": "fake",
            "backend": "openai",
            "tokenizer_path": str(ensure_local_model()),
            "context_length": context,
        },
        client={"max_attempts": 1, "max_consecutive_failures": failures},
        max_running_requests=1,  # requests in prompt order: the refusals come in a row
        startup_timeout_s=10,
    )
    return dg.materialize(
        [completions],
        instance=instance,
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=cap),
        },
        partition_key=pk,
        raise_on_error=False,
    )


def test_long_prompts_are_set_aside_unsent_and_refusals_cost_their_row_only(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_local_model())
    lengths = {p: templated_length(tokenizer, p) for p in SHORT + LONG + REFUSED}
    assert all(lengths[p] + CAP <= CONTEXT for p in SHORT + REFUSED)
    assert all(lengths[p] + CAP > CONTEXT for p in LONG) and lengths[LONG[0]] + 8 <= CONTEXT < lengths[LONG[1]]

    root = tmp_path / "data"
    source = tmp_path / "prompts.jsonl"
    prompts = SHORT[:2] + LONG + REFUSED + SHORT[2:]
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    with dg.instance_for_test() as instance, FakeServer(script) as server:
        assert dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": 64}}}},
        ).success
        (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
        result = run_completions(instance, root, server.url, pk)
        assert result.success  # 5 refusals in a row, max_consecutive_failures 3: the run was not stopped
        sent = [last_user_message(b) for b in server.bodies]
        meta = result.asset_materializations_for_node("completions")[0].metadata
        rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")

        assert not set(LONG) & set(sent)  # never reached the server
        assert sorted(p for p in sent if p in prompts) == sorted(SHORT + REFUSED)
        by_prompt = dict(zip(prompts, rows.iter_rows(named=True)))
        for p in LONG:
            row = by_prompt[p]
            assert row["finish_reason"] == PROMPT_TOO_LONG and row["error"] is None
            assert (row["prompt_tokens"], row["max_output_tokens"], row["context_length"]) == (
                lengths[p],
                CAP,
                CONTEXT,
            )
            assert row["completion_tokens"] == 0 and row["content"] is None and row["attempts"] == 0
        for p in REFUSED:
            error = by_prompt[p]["error"]
            assert error.startswith(CONTEXT_REFUSED) and "HTTP 400" in error, error
            assert "resources.inference.external.context_length" in error and "context 200" in error
        for p in SHORT:
            assert by_prompt[p]["finish_reason"] == "stop" and by_prompt[p]["context_length"] == CONTEXT
        assert meta["prompt_too_long"].value == 2 and meta["set_aside_too_long"].value == 2
        assert meta["errors"].value == len(REFUSED) and meta["requested"].value == len(SHORT + REFUSED)
        assert meta["finish_reasons"].value == {"prompt_too_long": 2, "stop": 4}

        def sent_by(run) -> list[str]:  # the prompts a run sent (the server's bodies are a growing record)
            before = len(server.bodies)
            assert run().success
            return sorted(p for b in server.bodies[before:] if (p := last_user_message(b)) in prompts)

        # the same settings: the set-aside rows stay, only the refused (error) rows are requested again
        assert sent_by(lambda: run_completions(instance, root, server.url, pk)) == sorted(REFUSED)

        # a lower cap gives the first long prompt room: requested now; the second stays set aside
        resent = set(sent_by(lambda: run_completions(instance, root, server.url, pk, cap=8)))
        assert LONG[0] in resent and LONG[1] not in resent
        rows = pl.read_parquet(root / "completions" / f"{pk}.parquet").sort("index")
        by_prompt = dict(zip(prompts, rows.iter_rows(named=True)))
        assert by_prompt[LONG[0]]["finish_reason"] == "stop"
        assert (by_prompt[LONG[1]]["finish_reason"], by_prompt[LONG[1]]["max_output_tokens"]) == (PROMPT_TOO_LONG, 8)

        # a longer context gives the second room too (judged again from its stored length, then requested)
        assert LONG[1] in sent_by(lambda: run_completions(instance, root, server.url, pk, cap=8, context=4096))


def test_context_refusals_never_stop_the_client_but_other_400s_do():
    """More context refusals in a row than ``max_consecutive_failures`` deliver every row; the same number of
    another 400 stops the run (the rule the refusals are exempt from still holds)."""

    def refuse(message):
        return lambda n, body: Error(400, message) if last_user_message(body).startswith("x") else Reply()

    items = [(i, {"model": "fake", "messages": [{"role": "user", "content": f"x{i}"}]}) for i in range(6)]
    items.append((6, {"model": "fake", "messages": [{"role": "user", "content": "fine"}]}))
    for message, stops in ((VLLM_400, False), (SGLANG_400, False), ("unknown field 'foo'", True)):
        with FakeServer(refuse(message)) as server:
            client = CompletionClient([server.url], concurrency=1, max_attempts=2, max_consecutive_failures=3)
            results = []
            try:
                client.generate_blocking(items, results.append)
                stopped = False
            except Exception as exc:
                stopped = type(exc).__name__ == "TooManyFailuresError"
            assert stopped is stops, message
            assert server.requests_received == (3 if stops else 7)  # a 400 is never retried
        if not stops:
            assert [r.ok for r in results] == [False] * 6 + [True]
            assert all(r.context_refused and r.error.startswith(CONTEXT_REFUSED) for r in results[:6])


def test_set_aside_rows_are_judged_again_when_cap_or_context_changes():
    settings = GenerationSettings(max_output_tokens=64).with_context(200)
    row = {
        "finish_reason": PROMPT_TOO_LONG,
        "completion_tokens": 0,
        "prompt_tokens": 150,
        "max_output_tokens": 64,
        "context_length": 200,
        "settings_fingerprint": settings.sampling_fingerprint(),
    }
    assert invalid_reason(row, settings) is None
    assert invalid_reason(row, settings.model_copy(update={"max_output_tokens": 32})) == TOO_LONG_CAP
    assert invalid_reason(row, settings.model_copy(update={"max_output_tokens": 128})) == TOO_LONG_CAP
    assert invalid_reason(row, settings.with_context(4096)) == TOO_LONG_CONTEXT
    assert invalid_reason(row, settings.with_context(None)) is None  # context unknown here: the cap decides
    # the partition-level rule (status, run, sensor) from the metadata the commit writes
    meta = {"finish_reasons": {"stop": 3, PROMPT_TOO_LONG: 1}, "prompt_too_long_judged": [[64, 200]]}
    meta["settings_fingerprints"] = [settings.sampling_fingerprint()]
    assert settings_reason(meta, settings) is None
    assert settings_reason(meta, settings.model_copy(update={"max_output_tokens": 32})) == TOO_LONG_CAP
    assert settings_reason(meta, settings.with_context(300)) == TOO_LONG_CONTEXT
    # room: vLLM and SGLang both take prompt + cap == context (SGLang's own rule: test_sglang_contract)
    assert settings.prompt_room("vllm") == settings.prompt_room("sglang") == 200 - 64
    assert GenerationSettings().prompt_room() is None
    # the fingerprint and the stored settings never carry the context
    assert settings.settings_json == GenerationSettings(max_output_tokens=64).settings_json


def test_rows_set_aside_are_counted_apart_and_the_advice_counts_prompts_over_the_context():
    frame = pl.DataFrame(
        {
            "finish_reason": ["stop"] * 6 + ["length"] * 2 + [PROMPT_TOO_LONG],
            "completion_tokens": [10, 20, 30, 40, 50, 60, 64, 64, 0],
            "max_output_tokens": [64] * 9,
            "error": [None] * 9,
            "truncated_in_reasoning": [False] * 9,
            "empty_answer": [False] * 9,
            "source": ["s"] * 9,
        }
    )
    ok, counts = row_counts(frame)
    assert ok.height == 8 and counts["prompt_too_long"] == 1 and counts["finish_reasons"][PROMPT_TOO_LONG] == 1
    lengths = np.array([10, 50, 100, 120, 130, 130, 130, 130, 170])  # the last: the row set aside
    settings = GenerationSettings(max_output_tokens=64).with_context(200)
    advice = cap_advice(
        ok,
        64,
        prompt_lengths=lengths,
        room_at=lambda cap: settings.model_copy(update={"max_output_tokens": cap}).prompt_room(),
    )
    assert advice["prompts_over_context"] == 1  # 170 + 64 > 200
    for candidate in advice["candidates"]:
        assert candidate["prompts_over_context"] == int((lengths + candidate["cap"] > 200).sum())
    assert [(c["cap"], c["prompts_over_context"]) for c in advice["candidates"]][:2] == [(80, 5), (96, 6)]


def test_a_partition_whose_every_prompt_was_set_aside_tokenizes_to_nothing_and_passes_its_check():
    """Found by the vLLM main-job test: such a partition failed ``no_empty_loss_mask`` (no row kept), though it
    rightly has nothing to train on."""
    from transformers import AutoTokenizer

    from dflash_assets.data.sequence_builder import SequenceBuilder
    from dflash_assets.data.tokenization import TokenizePolicy, tokenize_partition
    from dflash_assets.generation.rows.records import rows_to_frame, too_long_row
    from dflash_assets.stages.tokenized import TokenizeConfig, run_checks

    settings = GenerationSettings(max_output_tokens=CAP).with_context(CONTEXT)
    prompts = pl.DataFrame(
        {
            "index": [0, 1],
            "prompt_id": ["a", "b"],
            "content_hash": ["ha", "hb"],
            "source": ["s", "s"],
            "messages": [[{"role": "user", "content": p}] for p in LONG],
        }
    )
    completions_frame = rows_to_frame([too_long_row(p, settings, 300) for p in prompts.iter_rows(named=True)])
    builder = SequenceBuilder(AutoTokenizer.from_pretrained(ensure_local_model()))
    tokenized, aside, counts = tokenize_partition(completions_frame, prompts, builder, TokenizePolicy(truncated="keep"))
    assert tokenized.height == 0 and counts["prompt_too_long"] == 2
    assert all(r.startswith(PROMPT_TOO_LONG) for r in aside["reason"])
    checks = {c.check_name: c.passed for c in run_checks(tokenized, completions_frame, builder, TokenizeConfig(), CAP)}
    assert checks["no_empty_loss_mask"] is True
    # one generated row among them: the empty table is a failure again
    mixed = pl.concat([completions_frame, completions_frame.head(1).with_columns(finish_reason=pl.lit("stop"))])
    checks = {c.check_name: c.passed for c in run_checks(tokenized, mixed, builder, TokenizeConfig(), CAP)}
    assert checks["no_empty_loss_mask"] is False
