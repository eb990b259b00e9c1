"""Issue 27, server replies: a hostile reply fails its own request (retried where transient), is recorded as the
row's error with the reason and never reaches storage as data; a row the store cannot take never blocks its
partition's commit; a trickled reply is cut off by the whole-request deadline.

One stand-in server process for the module (``stand_in_server --script hostile``, a real socket): the prompt
names the reply (:mod:`dflash_simulators.hostile_replies`). It stands in for what no real server can be
made to send on demand."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.rows.journal import RowJournal
from dflash_assets.generation.rows.records import COMPLETIONS_SCHEMA, row_from_result, row_problem, rows_to_frame
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.tables import partition_frame
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.hostile_replies import HOSTILE, PREFIX, TEST_VOCAB_SIZE

CAP = 16


@pytest.fixture(scope="module")
def hostile_url():
    """``http://127.0.0.1:<port>`` of a hostile stand-in server in its own process (one per module)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_simulators.stand_in_server", "--script", "hostile"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(10)


def body(prompt: str) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": prompt}], "max_tokens": CAP}


# what each hostile reply's row error must say, and how many attempts it gets (2 when transient, of 2)
EXPECTED = {
    "deep": ("malformed reply from {url}: the 200,013-byte body nests deeper than the JSON reader allows", 1),
    "surrogate-content": (
        "malformed reply from {url}: message.content holds a lone surrogate (\\ud800 at character 7)",
        1,
    ),
    "surrogate-reasoning": ("malformed reply from {url}: message.reasoning_content holds a lone surrogate (\\udfff", 1),
    "token-id-2^31": (
        "malformed reply from {url}: choices[0].token_ids[1] is 2147483648, outside the vocabulary "
        "[0, 1,000): not a token id",
        1,
    ),
    "token-id-vocab": ("choices[0].token_ids[1] is 1000, outside the vocabulary [0, 1,000)", 1),
    "token-id-negative": ("choices[0].token_ids[0] is -1, outside the vocabulary", 1),
    "prompt-tokens-2^63": ("usage.prompt_tokens is 9223372036854775808, outside [0, 2**31): not a token count", 1),
    "completion-tokens-2^64": ("usage.completion_tokens is 18446744073709551616, outside [0, 2**31)", 1),
    "completion-tokens-negative": ("usage.completion_tokens is -3, outside [0, 2**31)", 1),
    "oversize": ("reply from {url} is over the 8,388,608-byte cap (its Content-Length says 9,437,", 1),
    "oversize-undeclared": ("reply from {url} is over the 8,388,608-byte cap (read so far:", 1),
    "gzip-bomb": ("reply from {url} is over the 8,388,608-byte cap (read so far:", 1),
    "trickle": ("request timeout after 1 s from {url}: no whole reply in that time", 2),
    "error-deep": ('HTTP 500 from {url}: {{"error": [[[[', 2),
    "error-surrogate": ("HTTP 400 from {url}: bad \\ud800 input", 1),
}


def test_each_hostile_reply_fails_its_own_row_with_the_reason_and_stores_no_data(hostile_url, tmp_path):
    """Was: a deep body (RecursionError) or a 500 with one ended the whole run; a lone surrogate stopped the
    journal writer; ids >= 2**31 became silent nulls; counts >= 2**63 failed every commit; negative counts
    were stored; bodies had no cap; a trickled reply held its slot for as long as it trickled."""
    assert set(EXPECTED) | {"trickle-once", "gzipped"} == set(HOSTILE)
    slow = ["trickle", "trickle-once"]  # a client with a 1 s deadline; the others get 30 s (a loaded machine)
    normal = [f"Task {i}: add {i} and {i}." for i in range(6)]
    prompts = [p for pair in zip(normal, [PREFIX + k for k in HOSTILE if k not in slow]) for p in pair]
    prompts += [PREFIX + k for k in [k for k in HOSTILE if k not in slow][len(normal) :]]
    results = []
    for batch, deadline_s in ((prompts, 30.0), ([PREFIX + k for k in slow], 1.0)):
        client = CompletionClient(
            [hostile_url],
            concurrency=8,
            max_attempts=2,
            backoff_base_s=0.01,
            backoff_max_s=0.02,
            max_consecutive_failures=100,
            read_timeout_s=30.0,
            request_timeout_s=deadline_s,
            vocab_size=TEST_VOCAB_SIZE,
        )
        first = len(results)
        asyncio.run(client.generate(((first + i, body(p)) for i, p in enumerate(batch)), results.append))
    prompts += [PREFIX + k for k in slow]
    by_prompt = {prompts[r.index]: r for r in results}
    assert len(results) == len(prompts)  # the run went on past every hostile reply
    for kind, (says, attempts) in EXPECTED.items():
        result = by_prompt[PREFIX + kind]
        assert result.error is not None and says.format(url=hostile_url) in result.error, (kind, result.error)
        assert result.attempts == attempts, (kind, result.attempts)
        assert result.content is result.output_token_ids is result.prompt_tokens is result.completion_tokens is None
    assert "(gave up after 2 attempts)" in by_prompt[PREFIX + "trickle"].error
    assert 2.0 <= by_prompt[PREFIX + "trickle"].latency_s < 5.0  # two 1 s deadlines; the trickle takes ~15 s
    gzipped = by_prompt[PREFIX + "gzipped"]
    assert (gzipped.error, gzipped.attempts, gzipped.content) == (None, 1, "gzipped fine")
    once = by_prompt[PREFIX + "trickle-once"]  # transient: the retry got a whole reply
    assert (once.error, once.attempts, once.content) == (None, 2, "Answer to: hostile:trickle-once")
    for prompt in normal:
        ok = by_prompt[prompt]
        assert (ok.error, ok.content, ok.output_token_ids, ok.completion_tokens) == (
            None,
            f"Answer to: {prompt}",
            [1, 2, 3, 4, 5],
            5,
        )

    # every row journals and stores: the hostile ones as errors only, nothing of what the server sent
    settings = GenerationSettings(max_output_tokens=CAP)
    rows = [
        row_from_result(r, {"index": r.index, "prompt_id": f"p{r.index}", "source": "s"}, settings) for r in results
    ]
    assert [row_problem(row) for row in rows] == [None] * len(rows)
    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append_many(rows)
    frame = rows_to_frame(list(journal.load().values()))
    assert frame.height == len(prompts) and journal.skipped_lines == 0
    hostile = frame.filter(pl.col("error").is_not_null())
    assert hostile.height == len(EXPECTED) and frame.height - hostile.height == len(normal) + 2
    assert (
        hostile.select("content", "reasoning_content", "output_token_ids", "prompt_tokens", "completion_tokens")
        .null_count()
        .row(0)
        == (hostile.height,) * 5
    )


def write_corpus(instance, root, prompts: list[str]) -> str:
    source = root.parent / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": len(prompts)}}}},
    ).success
    (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
    return pk


def hostile_inference(url: str, model_dir, **fields) -> InferenceServerResource:
    return InferenceServerResource(
        **{
            "mode": "external",
            "base_urls": [url + "/v1"],
            "served_model_name": "fake",
            "external_backend": "openai",
            "external_tokenizer_path": str(model_dir),
            "max_running_requests": 4,
            "max_attempts": 2,
            "backoff_base_s": 0.01,
            "max_consecutive_failures": 50,
            "request_timeout_s": 1.0,
            "startup_timeout_s": 10.0,
            "continue_truncated": False,
            **fields,
        }
    )


def run_partition(instance, root, pk, inference, raise_on_error=True):
    return dg.materialize(
        [completions],
        instance=instance,
        partition_key=pk,
        raise_on_error=raise_on_error,
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=CAP, temperature=0.0),
        },
    )


ASSET_KINDS = [
    "deep",
    "surrogate-content",
    "token-id-vocab",
    "prompt-tokens-2^63",
    "completion-tokens-negative",
    "oversize",
    "trickle-once",
    "error-surrogate",
]


def test_a_range_run_over_hostile_replies_and_unstorable_journal_rows_commits_the_partition(hostile_url, tmp_path):
    """Was: one hostile reply ended the run (or stopped the journal writer), and a journal row with a count
    >= 2**63 made every commit of its partition fail on every rerun until the journal was edited by hand."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": TEST_VOCAB_SIZE}))
    normal = [f"Task {i}: add {i} and {i}." for i in range(6)]
    prompts = normal + [PREFIX + k for k in ASSET_KINDS]
    root = tmp_path / "data"
    settings = GenerationSettings(max_output_tokens=CAP, temperature=0.0)
    with dg.instance_for_test() as instance:
        pk = write_corpus(instance, root, prompts)
        corpus = pl.read_parquet(root / "prompt_corpus" / "corpus.parquet")
        # journal rows an older version (or a bad disk) left: valid-looking, but no table can take them as they are
        unstorable = {
            0: {"prompt_tokens": 2**64},
            1: {"content": "\ud800"},
            2: {"output_token_ids": [7, 2**31]},
            3: {"completion_tokens": "5"},
        }
        longer = {4: {"completion_tokens": CAP + 4}}  # a good row past the cap: planning cuts or redoes it
        (root / "completions").mkdir()
        with open(root / "completions" / f"{pk}.journal.jsonl", "w") as f:
            for i, bad in {**unstorable, **longer}.items():
                good = {
                    **{k: None for k in COMPLETIONS_SCHEMA},
                    "index": i,
                    "prompt_id": corpus["prompt_id"][i],
                    "source": corpus["source"][i],
                    "content": "old",
                    "finish_reason": "stop",
                    "prompt_tokens": 9,
                    "completion_tokens": 5,
                    "max_output_tokens": CAP,
                    "error": None,
                    "settings_fingerprint": settings.sampling_fingerprint(),
                    "settings": settings.settings_json,
                }
                f.write(json.dumps({**good, **bad}) + "\n")  # ASCII: the surrogate as its JSON escape
        result = run_partition(instance, root, pk, hostile_inference(hostile_url, model_dir))
    assert result.success
    meta = {k: v.value for k, v in result.asset_materializations_for_node("completions")[0].metadata.items()}
    assert meta["request_reasons"] == {
        "unstorable row": len(unstorable),
        "cap lowered": 1,
        "missing": len(prompts) - len(unstorable) - 1,
    }
    table = pl.read_parquet(root / "completions" / f"{pk}.parquet")
    assert table["index"].to_list() == list(range(len(prompts)))
    good = table.filter(pl.col("error").is_null())
    assert good["content"].to_list() == [f"Answer to: {p}" for p in normal] + ["Answer to: hostile:trickle-once"]
    assert good["output_token_ids"].to_list() == [[1, 2, 3, 4, 5]] * len(good)
    bad = table.filter(pl.col("error").is_not_null())
    assert bad["index"].to_list() == [len(normal) + k for k, kind in enumerate(ASSET_KINDS) if kind != "trickle-once"]
    assert (
        bad.select("content", "output_token_ids", "prompt_tokens", "completion_tokens").null_count().row(0)
        == (bad.height,) * 4
    )
    assert meta["errors"] == bad.height and meta["rows_set_aside"] == 0
    assert not (root / "completions" / f"{pk}.journal.jsonl").exists()


def test_a_row_the_table_cannot_take_is_set_aside_at_commit_and_the_rest_is_written(tmp_path):
    """The commit's own floor: whatever a row holds, the partition's table is written."""
    from dflash_assets.storage.store import Storage

    prompts = pl.DataFrame({"index": [0, 1, 2, 3, 4], "prompt_id": [f"p{i}" for i in range(5)], "source": ["s"] * 5})
    row = {
        "prompt_id": "p",
        "source": "s",
        "content": "fine",
        "finish_reason": "stop",
        "prompt_tokens": 9,
        "completion_tokens": 5,
        "output_token_ids": [1, 2],
        "latency_s": 0.5,
        "attempts": 1,
    }
    rows = {
        0: {**row, "index": 0},
        1: {**row, "index": 1, "prompt_tokens": 2**63},
        2: {**row, "index": 2, "latency_s": "slow"},
        3: {**row, "index": 3, "output_token_ids": [1, 2**40]},
        4: {**row, "index": 4, "reasoning_content": "a \udc80"},
    }
    frame, set_aside = partition_frame(Storage(str(tmp_path)), "0000000-0000004", prompts, rows)
    assert set_aside == {
        1: "prompt_tokens is 9223372036854775808, outside [0, 2**31)",
        2: "latency_s is a str, not a number",
        3: "output_token_ids holds 1099511627776, outside [0, 2**31)",
        4: "reasoning_content holds a lone surrogate at character 2 (not valid Unicode)",
    }
    assert frame["content"].to_list() == ["fine", None, None, None, None]
    assert frame["prompt_id"].to_list() == ["p", "p1", "p2", "p3", "p4"]  # a set-aside row: its prompt's identity
    assert frame["error"][1] == (
        "set aside: the row could not be stored (prompt_tokens is 9223372036854775808, "
        "outside [0, 2**31)); the next run requests it again"
    )
    assert frame["output_token_ids"].to_list()[:2] == [[1, 2], None]  # never a silent null inside a list


def test_a_failed_journal_append_stops_the_run_loudly_and_keeps_the_rows_before_it(hostile_url, tmp_path, monkeypatch):
    """Was: after a partial write and a full disk the journal went on appending; the next rows were glued to the
    partial line and lost while their appends had returned."""
    import errno

    import dflash_assets.generation.rows.journal as journal_module

    prompts = [f"Task {i}: add {i} and {i}." for i in range(12)]
    root = tmp_path / "data"
    calls = []  # rows in each batch the journal wrote

    class DiskFills:
        """The journal's ``os``, whose second write lands half its bytes, then finds the disk full. (Not the
        third: the writer group-commits whatever rows arrived during its last fsync, and on a machine with a
        slow fsync all 12 rows came in two writes, so a third never happened; a second always does, because
        the first write holds the one row the writer woke for.)"""

        def __getattr__(self, name):
            return getattr(os, name)

        def write(self, fd, data):
            calls.append(bytes(data).count(b"\n"))
            if len(calls) == 2:
                os.write(fd, bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, "No space left on device")
            return os.write(fd, data)

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": TEST_VOCAB_SIZE}))
    with dg.instance_for_test() as instance:
        pk = write_corpus(instance, root, prompts)
        monkeypatch.setattr(journal_module, "os", DiskFills())
        inference = hostile_inference(hostile_url, model_dir, max_running_requests=1)  # a batch per row
        result = run_partition(instance, root, pk, inference, raise_on_error=False)
        monkeypatch.setattr(journal_module, "os", os)
    assert not result.success
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    path = root / "completions" / f"{pk}.journal.jsonl"
    assert f"appending to journal {path} failed ([Errno 28] No space left on device)" in message
    assert "Free space on (or fix) the disk it is on and rerun" in message
    assert len(calls) == 2  # no append after the failed one
    data = path.read_bytes()
    durable = calls[0]  # the rows of the batch written before the disk filled
    assert data.endswith(b"\n") and data.count(b"\n") == durable < len(prompts)  # the partial line cut off
    journal = RowJournal(path)
    assert len(journal.load()) == durable and journal.skipped_lines == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
