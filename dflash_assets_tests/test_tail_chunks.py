"""The end of a run generated in chunks (``inference.client.tail_chunk_tokens``): each chunked row is the row one
request at the cap makes, the follow-ups go out only after every fresh prompt, and the metadata says
which rows were chunked.

References: the GPU-node simulator's own one-request reply (``sglang_stub.reply_fields``, one length per
prompt) for the row, and a run without chunking over the same prompts for the tables.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import dagster as dg
import polars as pl
import pytest

from dflash_assets.common.conversation import api_messages  # the messages as the server received them
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import row_from_result
from dflash_assets.generation.rows.tail_chunks import TailChunker
from dflash_assets.stages.completions.continuing import ContinuationPlanner
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets_tests.test_completions_asset import write_corpus
from dflash_assets_tests.test_node_scale import range_materialize, sglang_sim
from dflash_simulators.simulated_replies import drawn_length, reply_fields
from dflash_simulators.thinking_tokenizer import write_thinking_tokenizer

PROMPT = {"index": 3, "prompt_id": "t:3", "source": "t", "messages": [{"role": "user", "content": "prompt 3"}]}
FIELDS = (
    "reasoning_content",
    "content",
    "finish_reason",
    "completion_tokens",
    "truncated_in_reasoning",
    "empty_answer",
)

RECEIVE_JITTER_S = 0.005  # seconds: receive-time disorder of requests sent at one moment (per server or across)


def result_of(fields: dict, index: int = 3, server: str = "http://s") -> SimpleNamespace:
    return SimpleNamespace(
        index=index,
        content=fields["content"],
        reasoning_content=fields["reasoning_content"],
        finish_reason=fields["finish_reason"],
        prompt_tokens=10,
        completion_tokens=fields["completion_tokens"],
        output_token_ids=None,
        latency_s=0.1,
        server=server,
        attempts=1,
        error=None,
    )


@pytest.mark.parametrize(
    "length",
    [
        30,  # done within the first chunk: one request, no follow-up
        100,  # thinking closes at 90, inside the third chunk
        72,  # thinking (65 tokens) closes inside the second chunk
        64,  # exactly two chunks
        93,  # thinking closes at 84... the answer straddles the last seam
        300,  # still thinking at the cap (cap 256): length
        283,  # thinking closes at 255, one token before the cap
    ],
)
def test_a_chunked_row_is_the_row_one_request_at_the_cap_makes(length):
    cap, chunk = 256, 32
    settings = GenerationSettings(max_output_tokens=cap)
    chunker = TailChunker(settings, "m", dict, opened=False, chunk_tokens=chunk, window_rows=1, total_rows=1)
    body = chunker.first_body(1, PROMPT, settings.request_body("m", PROMPT["messages"], 3))
    assert body["max_tokens"] == chunk and body["separate_reasoning"] is False  # raw text: no parser trimming
    done, requests = 0, 1
    while True:
        reply = reply_fields(length, body["max_tokens"], done, raw=True)
        result = result_of(reply)
        following = chunker.follow_up(result)
        if following is None:
            break
        requests += 1
        done += reply["completion_tokens"]
        prefix = following["messages"][-1]["content"]
        assert following["continue_final_message"] and sum(w in ("t", "a") for w in prefix.split()) == done
        assert following["max_tokens"] == min(chunk, cap - done)
        body = following
    row = chunker.final_row(result, PROMPT)
    want = row_from_result(result_of(reply_fields(length, cap)), PROMPT, settings)
    assert {k: row[k] for k in FIELDS} == {k: want[k] for k in FIELDS}
    assert requests == math.ceil(min(length, cap) / chunk)
    assert row["tail_chunks"] == (requests if requests > 1 else 0) and row["continued_from_tokens"] == 0
    assert chunker.follow_ups == requests - 1
    assert row["latency_s"] == pytest.approx(0.1 * requests) and row["attempts"] == requests


def raw_result(text: str, tokens: int, finish: str = "length", index: int = 3) -> SimpleNamespace:
    return SimpleNamespace(
        index=index,
        content=text,
        reasoning_content=None,
        finish_reason=finish,
        prompt_tokens=10,
        completion_tokens=tokens,
        output_token_ids=[1] * tokens,
        latency_s=0.1,
        server="s",
        attempts=1,
        error=None,
    )


@pytest.mark.parametrize(
    "opened, pieces, reasoning, answer",
    [
        # a cut right after a paragraph break: the prefix keeps the "\n\n" (a reasoning parser strips it)
        (
            False,
            ["<think>\nStep one.\n\n", "Step two.\n</think>\n\nThe answer."],
            "Step one.\n\nStep two.",
            "The answer.",
        ),
        # a cut right after </think>: the answer that follows is the answer, not more thinking
        (False, ["<think>\nAll thought.\n</think>\n\n", "The answer."], "All thought.", "The answer."),
        # a template whose generation prompt opens <think>: the text starts inside the thinking
        (True, ["Thinking, cut ", "here.\n</think>\n\nDone."], "Thinking, cut here.", "Done."),
    ],
)
def test_chunk_seams_keep_the_text_as_the_model_wrote_it(opened, pieces, reasoning, answer):
    settings = GenerationSettings(max_output_tokens=100)
    chunker = TailChunker(settings, "m", dict, opened=opened, chunk_tokens=10, window_rows=1, total_rows=1)
    chunker.first_body(1, PROMPT, settings.request_body("m", PROMPT["messages"], 3))
    so_far = ""
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        result = raw_result(piece, 10, "stop" if last else "length")
        following = chunker.follow_up(result)
        so_far += piece
        if last:
            assert following is None
        else:
            assert following["messages"][-1] == {"role": "assistant", "content": so_far}  # exactly what was written
            assert following["continue_final_message"] and following["separate_reasoning"] is False
    row = chunker.final_row(result, PROMPT)
    assert (row["reasoning_content"], row["content"]) == (reasoning, answer)
    assert not row["truncated_in_reasoning"] and not row["empty_answer"] and row["finish_reason"] == "stop"
    assert (
        row["completion_tokens"] == 10 * len(pieces)
        and row["output_token_ids"] is None
        and row["tail_chunks"] == len(pieces)
    )
    assert row["prompt_tokens"] == 10


def test_a_chunk_answered_afresh_or_failed_gives_an_error_row():
    from dflash_assets.generation.rows.continuation import NOT_CONTINUED

    settings = GenerationSettings(max_output_tokens=100)
    chunker = TailChunker(settings, "m", dict, opened=False, chunk_tokens=10, window_rows=2, total_rows=2)
    for k in (3, 4):
        chunker.first_body(k - 2, {**PROMPT, "index": k}, settings.request_body("m", PROMPT["messages"], k))
        assert chunker.follow_up(raw_result("<think>\nhalf ", 10, index=k)) is not None
    afresh = raw_result("<think>\nstarting over", 10, index=3)  # a server that ignored continue_final_message
    assert chunker.follow_up(afresh) is None
    row = chunker.final_row(afresh, {**PROMPT, "index": 3})
    assert row["error"] == NOT_CONTINUED and row["tail_chunks"] == 2 and row["reasoning_content"] is None
    failed = SimpleNamespace(
        **{**vars(raw_result("", 0, index=4)), "error": "HTTP 500", "finish_reason": None, "completion_tokens": None}
    )
    assert chunker.follow_up(failed) is None
    row = chunker.final_row(failed, {**PROMPT, "index": 4})
    assert row["error"] == "HTTP 500" and row["completion_tokens"] is None and row["attempts"] == 2


def test_only_the_window_is_chunked_and_a_chunk_at_or_above_the_cap_chunks_nothing():
    settings = GenerationSettings(max_output_tokens=100)
    chunker = TailChunker(settings, "m", dict, opened=False, chunk_tokens=40, window_rows=3, total_rows=10)
    caps = [chunker.first_body(k, {**PROMPT, "index": k}, {"max_tokens": 100})["max_tokens"] for k in range(1, 11)]
    assert caps == [100] * 7 + [40] * 3
    off = TailChunker(settings, "m", dict, opened=False, chunk_tokens=100, window_rows=10, total_rows=10)
    assert off.first_body(5, PROMPT, {"max_tokens": 100}) == {"max_tokens": 100} and off.rows_chunked == 0


@pytest.mark.parametrize(
    "change, why",
    [
        ({"seed": 7}, "makes a continued row differ"),
        ({"presence_penalty": 0.5}, "makes a continued row differ"),
    ],
)
def test_tail_chunking_is_off_for_sampling_that_is_not_history_free(change, why, tmp_path):
    settings = GenerationSettings(max_output_tokens=256, **change)
    part = SimpleNamespace(todo=[PROMPT])
    inference = InferenceServerResource(
        mode="sglang", model_path=str(write_thinking_tokenizer(tmp_path / "m", False)), tail_chunk_tokens=32
    )
    plan, note, problem = ContinuationPlanner(settings).tail(inference, [part], {})
    assert plan is None and why in note and not problem
    # and with history-free sampling the same config chunks, with the template's layout
    assert ContinuationPlanner(GenerationSettings(max_output_tokens=256)).tail(inference, [part], {}) == (
        (32, False),
        None,
        False,
    )
    no_continue = inference.model_copy(
        update={"client": inference.client.model_copy(update={"continue_truncated": False})}
    )
    plan, note, problem = ContinuationPlanner(GenerationSettings(max_output_tokens=256)).tail(no_continue, [part], {})
    assert plan is None and "continue_truncated is false" in note and problem


def test_a_range_run_with_tail_chunking_makes_the_same_tables_and_sends_follow_ups_last(tmp_path, monkeypatch):
    """Through the real asset and the GPU-node simulator: 24 prompts, 2 servers x 3 slots, the last
    2 x 6 = 12 chunked at 40 tokens. The tables equal a run without chunking in every text and count;
    each chunked prompt was sent ceil(min(length, cap) / 40) times, continuing from 40 k tokens; no
    follow-up left before the last fresh prompt; metadata counts the chunked rows and all their tokens."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    model = write_thinking_tokenizer(tmp_path / "target", opens_think=False)
    cap, chunk = 256, 40
    prompts = [f"prompt {i}" for i in range(24)]
    root, plain_root = tmp_path / "data", tmp_path / "plain"
    (tmp_path / "p").mkdir()
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=8)
        chunked = sglang_sim(tmp_path, 2, 3, model_path=str(model), tail_chunk_tokens=chunk, tail_prompts_per_slot=2.0)
        result = range_materialize(instance, root, keys, chunked, cap=cap)
        assert result.success
        plain_keys = write_corpus(instance, plain_root, prompts, partition_size=8)
        assert range_materialize(
            instance, plain_root, plain_keys, sglang_sim(tmp_path / "p", 2, 3, model_path=str(model)), cap=cap
        ).success
        log = [e.user_message for e in instance.all_logs(result.run_id)]
    got = pl.concat([pl.read_parquet(root / "completions" / f"{pk}.parquet") for pk in keys]).sort("index")
    plain = pl.concat([pl.read_parquet(plain_root / "completions" / f"{pk}.parquet") for pk in plain_keys]).sort(
        "index"
    )
    assert got.select(FIELDS).to_dicts() == plain.select(FIELDS).to_dicts()

    corpus = {r["index"]: r for r in pl.read_parquet(root.joinpath(*CORPUS_FILE)).iter_rows(named=True)}
    length = {
        i: min(drawn_length(api_messages(r["messages"]), 120, 0.5), cap) for i, r in corpus.items()
    }  # the simulator's draw
    window = set(sorted(corpus)[-12:])
    want_chunks = {i: math.ceil(length[i] / chunk) if i in window else 1 for i in corpus}
    assert sum(n > 1 for n in want_chunks.values()) >= 6  # the test means something: most of the window is long
    assert dict(zip(got["index"], got["tail_chunks"])) == {i: n if n > 1 else 0 for i, n in want_chunks.items()}
    assert got["continued_from_tokens"].to_list() == [0] * 24

    events = [
        e
        for e in map(json.loads, (tmp_path / "requests.jsonl").read_text().splitlines())
        if e["ev"] == "recv" and e["key"].startswith("prompt")
    ]
    sent: dict[int, list[dict]] = {}
    for e in events:
        sent.setdefault(int(e["key"].split()[1]), []).append(e)
    assert {corpus_index(corpus, k): len(v) for k, v in sent.items()} == want_chunks
    for chain in sent.values():
        assert [e["continued_from"] for e in chain] == [chunk * j for j in range(len(chain))]
    fresh = [e for e in events if e["continued_from"] == 0]
    follow_ups = [e for e in events if e["continued_from"] > 0]
    # Follow-ups last: no follow-up is sent before the last fresh prompt. A server logs a request when its handler
    # runs, and two requests sent at one moment on two connections can be handled in either order: 0.3 ms the other
    # way round across the two server processes (a whole-suite run, 2026-12-03) and 0.17 ms within one server
    # (CI, 2026-12-06). So the order holds within RECEIVE_JITTER_S, per server and across them, which is less than one
    # chunk's generation here (40 tokens at 87.5 x 50 tok/s: 9 ms): a follow-up sent early would precede by more.
    assert follow_ups
    for port in {e["port"] for e in events}:
        fresh_here = [e["t"] for e in fresh if e["port"] == port]
        first_follow_up = min((e["t"] for e in follow_ups if e["port"] == port), default=math.inf)
        assert first_follow_up >= max(fresh_here, default=0) - RECEIVE_JITTER_S
    assert min(e["t"] for e in follow_ups) >= max(e["t"] for e in fresh) - RECEIVE_JITTER_S

    metas = {
        m.partition: {k: getattr(v, "value", v) for k, v in m.metadata.items()}
        for m in result.asset_materializations_for_node("completions")
    }
    assert sum(m["tail_chunked"] for m in metas.values()) == sum(n > 1 for n in want_chunks.values())
    assert sum(m["tail_chunk_requests"] for m in metas.values()) == sum(n for n in want_chunks.values() if n > 1)
    assert sum(m["output_tokens_generated"] for m in metas.values()) == sum(length.values())
    assert sum(m["continued"] for m in metas.values()) == 0
    assert {pk: m["tail_chunked_in_table"] for pk, m in metas.items()} == {
        pk: int((pl.read_parquet(root / "completions" / f"{pk}.parquet")["tail_chunks"] > 0).sum()) for pk in keys
    }
    assert any("generated in chunks of 40 tokens" in m for m in log)


def corpus_index(corpus: dict[int, dict], prompt_number: int) -> int:
    """The corpus index of the bench prompt ``prompt <n>`` (write_corpus keeps the order)."""
    return sorted(corpus)[prompt_number]


def test_follow_up_lanes_keep_a_row_on_its_server_and_balance_by_stealing_the_cheapest_prefix():
    from dflash_assets.generation.client.follow_ups import FollowUpLanes

    lanes = FollowUpLanes(steal_margin=2)
    assert lanes.take("a") is None and not lanes
    for k, tokens in enumerate([900, 300, 600, 100]):  # four rows made on server a, oldest first
        lanes.push("a", tokens, k, {"n": k})
    lanes.push("b", 50, 10, {"n": 10})
    # b's lane (1) is within 2 of a's (4)? no: 4 - 1 = 3 > 2, so b's slot steals a's cheapest prefix (row 3)
    assert lanes.take("b") == (3, {"n": 3}, "b")
    # now a: 3 items, b: 1; a's own slot takes a's oldest
    assert lanes.take("a") == (0, {"n": 0}, "a")
    # a: 2, b: 1: within the margin, so b takes its own
    assert lanes.take("b") == (10, {"n": 10}, "b")
    # a slot on a server with no lane (or a worker that has sent nothing yet) takes the longest lane's cheapest
    assert lanes.take("c") == (1, {"n": 1}, "c")
    assert lanes.take(None) == (2, {"n": 2}, None)
    assert len(lanes) == 0 and lanes.take("a") is None


def test_servers_that_answer_chunks_afresh_stop_the_run_and_small_runs_are_not_chunked(tmp_path, monkeypatch):
    """A server ignoring continue_final_message (``--sim-ignore-continue``) answers every follow-up afresh:
    ``max_consecutive_failures`` such rows in a row stop the run (a rerun would chunk them again), and no
    wrong row is stored. A run whose fresh prompts all fit in the slots at once chunks nothing."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    model = write_thinking_tokenizer(tmp_path / "target", opens_think=False)
    prompts = [f"prompt {i}" for i in range(24)]
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, prompts, partition_size=8)
        ignoring = sglang_sim(
            tmp_path,
            2,
            3,
            "--sim-ignore-continue",
            model_path=str(model),
            tail_chunk_tokens=40,
            tail_prompts_per_slot=2.0,
            max_consecutive_failures=3,
        )
        result = range_materialize(instance, root, keys, ignoring, cap=256, raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        message = str(failure.event_specific_data.error.message)
        assert "answered afresh" in message and "tail_chunk_tokens: 0" in message and "requested again whole" in message
        stored = [pl.read_parquet(p) for p in (root / "completions").glob("*.parquet")]
        chunked = pl.concat(stored).filter(pl.col("tail_chunks") > 0) if stored else pl.DataFrame()
        assert chunked.is_empty() or chunked["error"].is_not_null().all()  # afresh text is never stored as a row

        small_root = tmp_path / "small"
        small_keys = write_corpus(instance, small_root, prompts[:6], partition_size=3)
        (tmp_path / "s").mkdir()
        fits = sglang_sim(tmp_path / "s", 2, 3, model_path=str(model), tail_chunk_tokens=40)
        small = range_materialize(instance, small_root, small_keys, fits, cap=256)
        assert small.success
        log = [e.user_message for e in instance.all_logs(small.run_id)]
        assert any("fit in the 6 slots at once" in m for m in log)
        # a window that rounds to no prompt says so (it said "fit in the slots" for 12 prompts on 6)
        tiny_root = tmp_path / "tiny"
        tiny_keys = write_corpus(instance, tiny_root, prompts[:12], partition_size=6)
        (tmp_path / "t").mkdir()
        tiny = sglang_sim(tmp_path / "t", 2, 3, model_path=str(model), tail_chunk_tokens=40, tail_prompts_per_slot=0.01)
        tiny_run = range_materialize(instance, tiny_root, tiny_keys, tiny, cap=256)
        assert tiny_run.success
        log = [e.user_message for e in instance.all_logs(tiny_run.run_id)]
        assert any("tail_prompts_per_slot 0.01 x 6 slots rounds to no prompt" in m for m in log)
    events = [json.loads(line) for line in (tmp_path / "s" / "requests.jsonl").read_text().splitlines()]
    assert all(e.get("continued_from", 0) == 0 for e in events if e["ev"] == "recv")
    assert all(e["max_tokens"] == 256 for e in events if e["ev"] == "recv" and e["key"].startswith("prompt"))
