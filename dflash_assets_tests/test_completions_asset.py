"""Acceptance tests of the ``completions`` asset (issue 3).

1. Real server (``local_inference``, greedy SmolLM2 on CPU): two partitions of real prompts at a small
   cap complete with both ``stop`` and ``length`` rows, ``completion_tokens <= cap``, and materialization
   metadata equal to counts computed from the written table.
2. SIGKILL mid-partition (the first run is a subprocess), then a rerun: every prompt once in the table,
   and no row that was in the journal at kill time is requested again, counted at the wire by
   :class:`~dflash_simulators.counting_proxy.CountingProxy` in front of the real server.
3. Faults from :class:`~dflash_simulators.stand_in_server.FakeServer` (external mode, backend "openai"):
   503 bursts, hung requests, dropped connections, and a server that dies mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.generation.rows.journal import RowJournal
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.behaviours import Drop, Error, Hang, Reply
from dflash_simulators.counting_proxy import CountingProxy, last_user_message
from dflash_simulators.stand_in_server import FakeServer

REPO = Path(__file__).resolve().parents[1]

# Greedy SmolLM2-135M-Instruct at cap 16: the short questions stop after 4-11 tokens, the coding
# and explanation tasks run past the cap (measured; each partition holds both kinds).
CAP = 16
REAL_PROMPTS = [
    "What is 2+2? Answer with just the number.",
    "Write a Python function that reverses a string.",
    "Translate 'hello' to Spanish. One word.",
    "Explain how a hash table works.",
    "What is the capital of France? Answer in one word.",
    "Write a C++ program that calculates the area of a rectangle, given its width and height.\n\nwidth: 5, height: 8",
    "What is 10 times 3? Just the number.",
    "Write a SQL query that selects all rows from the users table.",
]
# Long-running coding prompts for the kill test: every one runs to the cap, so rows finish steadily.
KILL_PROMPTS = [
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "How can you implement a basic web server using Node.js and Express?",
    "Write a JavaScript function that checks whether a string is a palindrome.",
    "Implement binary search in Java.",
    "Write a Go program that reads a file line by line.",
    "Explain the difference between a process and a thread.",
    "Write a Rust function that computes the factorial of a number.",
    "Write a shell script that counts the lines of every .txt file in a directory.",
    "Implement a stack in C with push and pop.",
]


# --------------------------------------------------------------------------------------------- helpers


def write_corpus(instance, root: Path, prompts: list[str], partition_size: int) -> list[str]:
    """Materialize ``prompt_corpus`` from a JSONL of plain prompts; returns the partition keys."""
    source = root.parent / f"{root.name}_prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": StorageResource(root=str(root))},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": partition_size}}}},
    )
    assert result.success
    return instance.get_dynamic_partitions(prompt_ranges.name)


def materialize(
    instance, root: Path, pk: str, inference: InferenceServerResource, cap: int = CAP, raise_on_error: bool = True
):
    return dg.materialize(
        [completions],
        instance=instance,
        partition_key=pk,
        raise_on_error=raise_on_error,
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference,
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=cap, temperature=0.0),
        },
    )


def metadata(result) -> dict:
    meta = result.asset_materializations_for_node("completions")[0].metadata
    return {k: v.value for k, v in meta.items()}


def table(root: Path, pk: str) -> pl.DataFrame:
    return pl.read_parquet(root / "completions" / f"{pk}.parquet")


def failure_message(result) -> str:
    events = result.get_step_failure_events()
    assert events, "expected a step failure"
    return events[0].event_specific_data.error.message


def fake_inference(url: str, **client) -> InferenceServerResource:
    """External mode against a FakeServer, tight client budget so faults resolve in seconds."""
    fields = {
        "mode": "external",
        "base_urls": [url + "/v1"],
        "served_model_name": "fake",
        "external_backend": "openai",
        "max_running_requests": 2,
        "max_attempts": 3,
        "backoff_base_s": 0.01,
        "max_consecutive_failures": 3,
        "request_timeout_s": 5.0,
        "startup_timeout_s": 10.0,
    }
    return InferenceServerResource(**{**fields, **client})


class PerPromptScript:
    """FakeServer script: ``rule(index, attempt)`` per real prompt (attempt 0-based, counted here);
    the startup probe (not a corpus prompt) always gets a Reply."""

    def __init__(self, prompts: list[str], rule):
        self.index = {p: i for i, p in enumerate(prompts)}
        self.rule = rule
        self.attempts: Counter = Counter()
        self._lock = threading.Lock()

    def __call__(self, n, body):
        i = self.index.get(last_user_message(body))
        if i is None:
            return Reply()
        with self._lock:
            k = self.attempts[i]
            self.attempts[i] += 1
        return self.rule(i, k)


def answer(i: int) -> Reply:
    """The reply the fake gives prompt ``i`` (content names the prompt, so rows can be matched)."""
    return Reply(content=f"Answer to task {i}.", reasoning=None, completion_tokens=5 + i % 3, prompt_tokens=9)


FAULT_PROMPTS = [f"Task {i}: write a function that returns {i} squared." for i in range(12)]


def assert_rows_match_prompts(frame: pl.DataFrame, expected_indices) -> None:
    assert frame["index"].to_list() == sorted(expected_indices)
    ok = frame.filter(pl.col("error").is_null())
    for row in ok.iter_rows(named=True):
        assert row["content"] == f"Answer to task {row['index']}."
        assert row["completion_tokens"] == 5 + row["index"] % 3


# ------------------------------------------------------------------------------ 1. real server, 2 partitions


def test_two_real_partitions_stop_and_length_metadata_matches_table(tmp_path, local_inference):
    from transformers import AutoTokenizer

    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, REAL_PROMPTS, partition_size=4)
        assert keys == ["0000000-0000003", "0000004-0000007"]
        metas = {pk: metadata(materialize(instance, root, pk, local_inference)) for pk in keys}
        first_bytes = (root / "completions" / f"{keys[0]}.parquet").read_bytes()
        # a second run finds every row valid: no request, same bytes
        again = metadata(materialize(instance, root, keys[0], local_inference))
    assert (root / "completions" / f"{keys[0]}.parquet").read_bytes() == first_bytes

    tokenizer = AutoTokenizer.from_pretrained(local_inference.tokenizer_path())
    for pk in keys:
        frame, meta = table(root, pk), metas[pk]
        assert not (root / "completions" / f"{pk}.journal.jsonl").exists()  # removed once the table is written
        assert frame.height == 4 and frame["error"].null_count() == 4
        reasons = Counter(frame["finish_reason"].to_list())
        assert set(reasons) == {"stop", "length"}, reasons
        for row in frame.iter_rows(named=True):
            assert row["completion_tokens"] <= CAP and row["max_output_tokens"] == CAP
            # transformers serve says "length" exactly when completion_tokens reaches max_tokens
            assert (row["finish_reason"] == "length") == (row["completion_tokens"] == CAP)
            assert row["content"].strip() and row["attempts"] == 1
            messages = [{"role": "user", "content": REAL_PROMPTS[row["index"]]}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            assert row["prompt_tokens"] == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        # metadata = counts computed from the table
        assert meta["rows"] == frame.height and meta["errors"] == 0
        assert meta["finish_reasons"] == dict(sorted(reasons.items()))
        assert meta["completion_tokens_total"] == frame["completion_tokens"].sum()
        assert meta["completion_tokens_max"] == frame["completion_tokens"].max()
        assert meta["length_row_caps"] == [CAP]
        assert meta["requested"] == 4 and meta["carried_over"] == 0 and meta["request_reasons"] == {"missing": 4}
        assert meta["max_output_tokens"] == CAP
    assert "4" in table(root, keys[0]).filter(pl.col("index") == 0)["content"][0]  # "2 + 2 = 4"
    assert (
        again["requested"] == 0 and again["carried_over"] == 4 and again["resumed_from_journal"] == 0
    )  # from the table
    assert again["finish_reasons"] == metas[keys[0]]["finish_reasons"]


# ------------------------------------------------------------------------------ 2. kill -9, then resume

_CHILD = """
import json, sys
import dagster as dg
from dflash_assets.assets.completions import completions
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.orchestration.runs import process_tags
a = json.loads(sys.argv[1])
with dg.instance_for_test(temp_dir=a["home"]) as instance:  # tagged with its process, as every product run is
    dg.materialize([completions], instance=instance, partition_key=a["pk"], tags=process_tags(), resources={
        "storage": StorageResource(root=a["root"]),
        "inference": InferenceServerResource(**a["inference"]),
        "target_model": TargetModelResource(),
        "generation": GenerationResource(max_output_tokens=a["cap"], temperature=0.0)})
"""


def test_kill_9_mid_partition_then_resume_requests_only_unfinished_rows(tmp_path, local_server, local_inference):
    root, home = tmp_path / "data", tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        (pk,) = write_corpus(instance, root, KILL_PROMPTS, partition_size=len(KILL_PROMPTS))
    journal_file = Path(StorageResource(root=str(root)).local_scratch("completions", f"{pk}.journal.jsonl"))

    with CountingProxy(local_server.base_url) as proxy:
        fields = {
            "mode": "external",
            "base_urls": [proxy.base_url],
            "served_model_name": local_server.model_name,
            "external_backend": "transformers",
            "max_running_requests": 2,
            "external_tokenizer_path": local_inference.external.tokenizer_path,
        }
        args = {"home": str(home), "root": str(root), "pk": pk, "cap": CAP, "inference": fields}
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 300
            while len(RowJournal(journal_file).load()) < 2:
                assert child.poll() is None, f"child exited early: {child.stderr.read().decode()[-3000:]}"
                assert time.monotonic() < deadline, "the child finished no 2 rows in 300 s"
                time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        assert child.returncode == -signal.SIGKILL
        journal = RowJournal(journal_file)
        at_kill = journal.load()  # the rows finished before the kill
        assert 2 <= len(at_kill) < len(KILL_PROMPTS), "the kill must land mid-partition"
        assert not (root / "completions" / f"{pk}.parquet").exists()
        first_run = proxy.requested
        assert all(first_run[KILL_PROMPTS[i]] == 1 for i in at_kill)

        proxy.reset()
        with dg.instance_for_test(temp_dir=str(home)) as instance:  # same instance, storage, settings
            resume = InferenceServerResource(**{**fields, "max_running_requests": 8})
            meta = metadata(materialize(instance, root, pk, resume))
        resumed = proxy.requested

    frame = table(root, pk)
    assert sorted(frame["index"].to_list()) == list(range(len(KILL_PROMPTS)))  # each prompt exactly once
    assert frame["error"].null_count() == frame.height
    for i in at_kill:
        assert resumed[KILL_PROMPTS[i]] == 0, f"row {i} was finished before the kill but requested again"
    for i in set(range(len(KILL_PROMPTS))) - set(at_kill):
        assert resumed[KILL_PROMPTS[i]] == 1
    assert meta["requested"] == len(KILL_PROMPTS) - len(at_kill) and meta["carried_over"] == len(at_kill)
    assert meta["resumed_from_journal"] == len(at_kill)  # the metadata says where the carried rows came from
    for i, row in at_kill.items():  # carried rows are the journal's, unchanged
        kept = frame.filter(pl.col("index") == i).row(0, named=True)
        assert (kept["content"], kept["completion_tokens"], kept["latency_s"]) == (
            row["content"],
            row["completion_tokens"],
            row["latency_s"],
        )
    assert not journal_file.exists()


# ------------------------------------------------------------------------------ 3. faults (fake server)


@pytest.fixture
def fault_partition(tmp_path):
    """(instance, storage root, partition key) over FAULT_PROMPTS in one partition."""
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        (pk,) = write_corpus(instance, root, FAULT_PROMPTS, partition_size=len(FAULT_PROMPTS))
        yield instance, root, pk


def test_503_burst_retried_then_success_attempts_recorded(fault_partition):
    instance, root, pk = fault_partition
    burst = 5
    arrivals = Counter()
    lock = threading.Lock()
    script = PerPromptScript(FAULT_PROMPTS, lambda i, k: answer(i))

    def first_arrivals_503(n, body):
        if last_user_message(body) in script.index:
            with lock:
                arrivals["real"] += 1
                if arrivals["real"] <= burst:  # the first requests meet an overloaded server
                    script.attempts[script.index[last_user_message(body)]] += 1
                    return Error(503, "Service Unavailable: overloaded")
        return script(n, body)

    with FakeServer(first_arrivals_503) as server:
        meta = metadata(materialize(instance, root, pk, fake_inference(server.url, max_attempts=burst + 1)))
    frame = table(root, pk)
    assert_rows_match_prompts(frame, range(len(FAULT_PROMPTS)))
    assert frame["error"].null_count() == frame.height and meta["errors"] == 0
    # every request that reached the server is one recorded attempt
    assert frame["attempts"].sum() == sum(script.attempts.values()) == len(FAULT_PROMPTS) + burst
    assert (frame["attempts"] > 1).sum() >= 1
    assert {i: a for i, a in zip(frame["index"], frame["attempts"])} == dict(script.attempts)


def test_hung_requests_time_out_retried_or_error_row_per_policy(fault_partition):
    instance, root, pk = fault_partition
    hang_once, hang_always = 3, 7

    def rule(i, k):
        if i == hang_always or (i == hang_once and k == 0):
            return Hang(120)
        return answer(i)

    script = PerPromptScript(FAULT_PROMPTS, rule)
    started = time.monotonic()
    with FakeServer(script) as server:
        meta = metadata(
            materialize(instance, root, pk, fake_inference(server.url, max_attempts=2, request_timeout_s=1.0))
        )
    assert time.monotonic() - started < 60  # three 1 s timeouts, not a 120 s hang
    frame = table(root, pk)
    assert_rows_match_prompts(frame, range(len(FAULT_PROMPTS)))
    rows = {r["index"]: r for r in frame.iter_rows(named=True)}
    assert rows[hang_once]["error"] is None and rows[hang_once]["attempts"] == 2
    # request_timeout_s bounds the whole request (issue 27), so it fires before the per-read timeout
    assert "request timeout after 1 s" in rows[hang_always]["error"] and rows[hang_always]["attempts"] == 2
    assert rows[hang_always]["finish_reason"] is None and rows[hang_always]["content"] is None
    assert meta["errors"] == 1 and meta["rows"] == len(FAULT_PROMPTS)
    assert script.attempts[hang_always] == 2 and script.attempts[hang_once] == 2

    # the next run retries the error row only
    healthy = PerPromptScript(FAULT_PROMPTS, lambda i, k: answer(i))
    with FakeServer(healthy) as server:
        meta = metadata(materialize(instance, root, pk, fake_inference(server.url)))
    assert dict(healthy.attempts) == {hang_always: 1}
    assert meta["request_reasons"] == {"error": 1} and meta["errors"] == 0
    assert table(root, pk)["error"].null_count() == len(FAULT_PROMPTS)


def test_dropped_connections_are_retried(fault_partition):
    instance, root, pk = fault_partition
    script = PerPromptScript(FAULT_PROMPTS, lambda i, k: Drop() if i % 2 == 0 and k == 0 else answer(i))
    with FakeServer(script) as server:
        meta = metadata(materialize(instance, root, pk, fake_inference(server.url)))
    frame = table(root, pk)
    assert_rows_match_prompts(frame, range(len(FAULT_PROMPTS)))
    assert frame["error"].null_count() == frame.height and meta["errors"] == 0
    assert frame["attempts"].to_list() == [2 if i % 2 == 0 else 1 for i in range(len(FAULT_PROMPTS))]


def test_server_dies_mid_run_clean_failure_rows_kept_then_resume_requests_only_missing(fault_partition):
    instance, root, pk = fault_partition
    replied_before_death = 4
    arrivals = Counter()
    lock = threading.Lock()

    def script(n, body):
        if last_user_message(body) not in FAULT_PROMPTS:
            return Reply()  # startup probe
        i = FAULT_PROMPTS.index(last_user_message(body))
        with lock:
            arrivals["real"] += 1
            if arrivals["real"] <= replied_before_death:
                return answer(i)
            if arrivals["real"] == replied_before_death + 1:
                threading.Thread(target=server.stop).start()  # dies with this request in flight
        return Hang(120)

    server = FakeServer(script).start()
    started = time.monotonic()
    try:
        result = materialize(instance, root, pk, fake_inference(server.url), raise_on_error=False)
    finally:
        server.stop()
    assert time.monotonic() - started < 60  # the retry budget, not the 120 s hang
    assert not result.success
    message = failure_message(result)
    assert "failed in a row" in message and "rerun the partition to resume" in message
    assert not (root / "completions" / f"{pk}.parquet").exists()
    journal = RowJournal(root / "completions" / f"{pk}.journal.jsonl").load()
    ok = {i for i, r in journal.items() if r["error"] is None}
    assert ok == {FAULT_PROMPTS.index(m) for m in map(last_user_message, server.replied_ok) if m in FAULT_PROMPTS}
    assert len(ok) == replied_before_death
    errored = set(journal) - ok
    assert len(errored) >= 3  # max_consecutive_failures
    assert all(journal[i]["attempts"] >= 1 for i in errored)

    healthy = PerPromptScript(FAULT_PROMPTS, lambda i, k: answer(i))
    with FakeServer(healthy) as server2:
        meta = metadata(materialize(instance, root, pk, fake_inference(server2.url)))
    # only the rows without a finished row were requested, each once
    assert dict(healthy.attempts) == {i: 1 for i in range(len(FAULT_PROMPTS)) if i not in ok}
    assert meta["requested"] == len(FAULT_PROMPTS) - len(ok) and meta["carried_over"] == len(ok)
    assert meta["resumed_from_journal"] == len(ok)
    assert meta["request_reasons"] == {
        k: v for k, v in {"error": len(errored), "missing": len(FAULT_PROMPTS) - len(journal)}.items() if v
    }
    frame = table(root, pk)
    assert_rows_match_prompts(frame, range(len(FAULT_PROMPTS)))
    assert frame["error"].null_count() == frame.height
    servers = {r["index"]: r["server"] for r in frame.iter_rows(named=True)}
    assert all(servers[i].startswith(server.url) for i in ok)  # the first run's rows were kept
    assert all(servers[i].startswith(server2.url) for i in set(range(len(FAULT_PROMPTS))) - ok)


def test_commit_overlays_new_rows_on_the_stored_table_and_writes_what_whole_rows_would(tmp_path):
    """The commit no longer holds every stored row in memory: it reads the last table back and lays the
    journal's and this run's rows over it. The file must be the one the whole rows as dicts give, byte
    for byte (the data version is its hash), also over a table written before ``continued_from_tokens``."""
    from dflash_assets.generation.rows.records import rows_to_frame
    from dflash_assets.stages.completions.tables import PLAN_COLUMNS, load_plan_rows, partition_file, partition_frame
    from dflash_assets.storage.store import Storage, parquet_bytes

    def row(i: int, text: str, tokens: int, **extra) -> dict:
        return {
            "index": i,
            "prompt_id": f"p{i}",
            "source": "s",
            "reasoning_content": text,
            "content": "a" * i,
            "finish_reason": "length" if tokens == 64 else "stop",
            "prompt_tokens": 9,
            "completion_tokens": tokens,
            "output_token_ids": list(range(tokens)),
            "truncated_in_reasoning": False,
            "empty_answer": False,
            "max_output_tokens": 64,
            "settings_fingerprint": "f",
            "settings": "{}",
            "latency_s": 0.5,
            "server": "s0",
            "attempts": 1,
            "error": None,
            **extra,
        }

    store = Storage(str(tmp_path))
    stored = [row(i, f"thinking {i} " * 40, 64 if i % 3 == 0 else 20 + i) for i in range(100, 110)]
    old_table = rows_to_frame(stored).drop("continued_from_tokens")  # as a table of an older version
    store.write_parquet(old_table, *partition_file("0000100-0000109"))
    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append_many([row(104, "from the journal", 33)])
    view, journal_rows = load_plan_rows(store, "0000100-0000109", journal)
    assert set(view) == set(range(100, 110)) and set(journal_rows) == {104}
    assert set(view[101]) == set(PLAN_COLUMNS) and view[104]["reasoning_content"] == "from the journal"

    new = {
        **journal_rows,
        103: row(103, "continued", 128, continued_from_tokens=64),
        109: row(109, None, 0, error="boom"),
    }
    # corpus rows: the commit reads their content_hash (an old row whose prompt_id is that hash names its prompt)
    prompts = pl.DataFrame({"index": list(range(100, 110)), "content_hash": [f"h{i}" for i in range(100, 110)]})
    frame, set_aside = partition_frame(store, "0000100-0000109", prompts, new)
    assert set_aside == {}
    whole = {r["index"]: r for r in stored} | new
    assert parquet_bytes(frame) == parquet_bytes(rows_to_frame(list(whole.values())))
    assert frame["continued_from_tokens"].to_list() == [0, 0, 0, 64, 0, 0, 0, 0, 0, 0]
    # a prompt dropped from the partition's range is not written back
    assert partition_frame(store, "0000100-0000109", prompts.head(5), new)[0]["index"].to_list() == [
        100,
        101,
        102,
        103,
        104,
    ]


def test_resumed_from_journal_counts_only_the_partitions_own_rows(tmp_path):
    """A journal row outside its partition's prompts (a corpus re-cut, a stray write) is not written to the
    table, so it must not count as resumed either: 5 such rows read as 'resumed 5' (review)."""
    import logging

    from dflash_assets.common.settings import GenerationSettings
    from dflash_assets.stages.completions.range_run import RangeRun
    from dflash_assets.storage.store import Storage

    settings = GenerationSettings(max_output_tokens=64)

    def row(i: int) -> dict:
        return {
            "index": i,
            "prompt_id": f"p{i}",
            "prompt_hash": f"h{i}",
            "source": "s",
            "reasoning_content": None,
            "content": "ok",
            "finish_reason": "stop",
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "output_token_ids": None,
            "truncated_in_reasoning": False,
            "empty_answer": False,
            "max_output_tokens": 64,
            "settings_fingerprint": settings.sampling_fingerprint(),
            "settings": settings.settings_json,
            "latency_s": 0.1,
            "server": "s0",
            "attempts": 1,
            "error": None,
        }

    journal = RowJournal(tmp_path / "j.jsonl")
    journal.append_many([row(i) for i in (2, 3, 100, 101, 102)])  # 2 of the partition's, 3 strays
    prompts = pl.DataFrame(
        {
            "index": list(range(10)),
            "prompt_id": [f"p{i}" for i in range(10)],
            "source": ["s"] * 10,
            "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(10)],
            "content_hash": [f"h{i}" for i in range(10)],
        }
    )  # the journal rows answer these prompts
    run = RangeRun(logging.getLogger("test"), Storage(str(tmp_path)), settings, ["0000000-0000009"])
    part = run.plan(
        "0000000-0000009",
        prompts,
        journal,
        InferenceServerResource(mode="external", base_urls=["http://127.0.0.1:9/v1"]),
    )
    assert part.resumed == 2 and len(part.todo) == 8


def test_a_range_run_commits_again_a_partition_whose_last_run_failed_with_its_table_intact(tmp_path):
    """New-user trial: a run of one partition failed at start-up (server down), leaving its table as it
    was; a range run over it then said 'complete and unchanged: kept', recorded nothing, and the UI and
    `status` kept showing the partition failed. Such a partition must be committed again."""
    from dflash_assets.app.status import stage_counts
    from dflash_assets_tests.test_node_scale import range_materialize

    root = tmp_path / "store"
    prompts = [f"Task {i}: write a function that returns {i} squared." for i in range(4)]
    with dg.instance_for_test() as instance, FakeServer(PerPromptScript(prompts, lambda i, k: answer(i))) as server:
        keys = write_corpus(instance, root, prompts, partition_size=2)
        assert range_materialize(instance, root, keys, fake_inference(server.url), cap=CAP).success
        down = fake_inference("http://127.0.0.1:9", startup_timeout_s=1.0)
        assert not materialize(
            instance, root, keys[1], down, cap=CAP + 8, raise_on_error=False
        ).success  # a raise, no server
        assert stage_counts(instance, "completions", keys)["failed_keys"] == [keys[1]]
        before = (root / "completions" / f"{keys[1]}.parquet").read_bytes()
        result = range_materialize(instance, root, keys, fake_inference(server.url), cap=CAP)
        assert result.success
        assert [m.partition for m in result.asset_materializations_for_node("completions")] == [keys[1]]  # keys[0] kept
        assert (root / "completions" / f"{keys[1]}.parquet").read_bytes() == before
        assert stage_counts(instance, "completions", keys)["done_keys"] == keys


def test_a_reversed_partition_range_fails_saying_so(tmp_path):
    """New-user trial: `--partition-range LAST...FIRST` succeeded in 51 ms having done nothing."""
    from dflash_assets_tests.test_node_scale import range_materialize

    root = tmp_path / "store"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, [f"q{i}" for i in range(4)], partition_size=2)
        result = range_materialize(
            instance, root, keys[::-1], fake_inference("http://127.0.0.1:9"), raise_on_error=False
        )
        assert not result.success and "is the partition range reversed?" in failure_message(result)
