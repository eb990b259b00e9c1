"""S3 storage on a real S3-compatible endpoint (moto_server on loopback): the storage layer, retries and
clear errors, journal segments synced and rebuilt, the pipeline prompt_corpus -> completions ->
tokenized_sequences on S3, kill -9 mid-partition with the scratch disk wiped, an endpoint outage mid-run,
and credentials absent from every log and metadata record."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from dagster._serdes import serialize_value

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.data.ranges import partition_keys
from dflash_assets.data.shapes import CORPUS_SCHEMA, build_corpus
from dflash_assets.generation.rows.journal_sync import SyncedRowJournal
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import CORPUS_FILE
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.storage.lock import writer_identity
from dflash_assets.storage.store import StorageError, is_transient
from dflash_simulators.behaviours import Reply
from dflash_simulators.stand_in_server import FakeServer

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401


def storage_resource(target, scratch, **overrides) -> StorageResource:
    """StorageResource on the test bucket, credentials by EnvVar (as definitions.py should wire them)."""
    fields = dict(
        root=target.root,
        scratch_dir=str(scratch),
        endpoint_url=target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
        retry_attempts=3,
        retry_backoff_s=0.1,
        retry_max_wait_s=0.4,
        connect_timeout_s=2,
        read_timeout_s=10,
        journal_sync_rows=3,
        journal_sync_s=0.3,
    )
    fields.update(overrides)
    return StorageResource(**fields)


def resolved(resource: StorageResource) -> StorageResource:
    """The resource with EnvVars resolved, for use outside a Dagster run."""
    return resource.process_config_and_initialize()


def write_prompts(path, n: int) -> list[str]:
    texts = [f"Task {i}: print the number {i} in Python." for i in range(n)]
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return texts


def write_corpus_direct(instance, storage: StorageResource, source, partition_size: int) -> None:
    """The corpus table and partitions without a Dagster run (the fault tests start at completions)."""
    resolved(storage).open().write_parquet(build_corpus([str(source)]).corpus, *CORPUS_FILE)
    keys = partition_keys(len(Path(source).read_text().splitlines()), partition_size)
    instance.add_dynamic_partitions(prompt_ranges.name, keys)


def materialize_corpus(instance, storage: StorageResource, source, partition_size: int):
    result = dg.materialize(
        [prompt_corpus],
        instance=instance,
        resources={"storage": storage},
        run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": partition_size}}}},
    )
    assert result.success
    return result


def fake_inference(server: FakeServer, mrr: int = 2) -> InferenceServerResource:
    return InferenceServerResource(
        mode="external",
        base_urls=[f"{server.url}/v1"],
        served_model_name="fake",
        max_running_requests=mrr,
        max_attempts=2,
        backoff_base_s=0.05,
    )


def requested_prompts(server: FakeServer, texts: list[str]) -> list[int]:
    """Prompt indexes of the generation requests the server received (the readiness probe excluded)."""
    position = {t: i for i, t in enumerate(texts)}
    return [position[b["messages"][-1]["content"]] for b in server.bodies if b["messages"][-1]["content"] in position]


def remote_journal_rows(target, pk: str) -> dict[int, dict]:
    """Rows in the synced journal segments, read straight from the bucket; every segment must be whole lines."""
    rows = {}
    for key in target.keys(f"completions/{pk}.journal/"):
        data = target.get(key)
        assert data.endswith(b"\n"), f"{key} is not whole lines"
        for line in data.splitlines():
            row = json.loads(line)
            rows[row["index"]] = row
    return rows


def event_log_text(instance) -> str:
    """Every run record and event of the instance, serialized (messages, metadata, errors, config)."""
    parts = []
    for run in instance.get_runs():
        parts.append(serialize_value(run))
        parts += [serialize_value(e) for e in instance.all_logs(run.run_id)]
    return "\n".join(parts)


def assert_no_credentials(creds, *texts: str) -> None:
    for text in texts:
        assert creds.secret_key not in text
        assert creds.access_key not in text


# -- storage layer ------------------------------------------------------------------------------


def test_is_transient_classification():
    def client_error(code, status):
        return ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    translated = OSError(errno.EBUSY, "Please reduce your request rate.")  # what s3fs raises for SlowDown
    translated.__cause__ = client_error("SlowDown", 503)
    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert is_transient(translated)
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(TimeoutError())
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(FileNotFoundError("bucket/key"))
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(NoCredentialsError())
    assert not is_transient(ValueError("bad"))


def test_storage_roundtrip_errors_and_throttling(s3_target, tmp_path, monkeypatch):
    store = resolved(storage_resource(s3_target, tmp_path)).open()
    frame = pl.DataFrame({"index": [0, 1, 2], "text": ["a", "b", "c"]})
    assert store.write_parquet(frame, "t", "x.parquet") == f"{s3_target.root}/t/x.parquet"
    assert store.read_parquet("t", "x.parquet").equals(frame)
    store.write_json({"k": 1}, "t", "sub", "y.json")
    assert store.listdir("t") == ["sub", "x.parquet"] and store.listdir("nothing") == []
    big = os.urandom(3 << 20)
    (tmp_path / "big.bin").write_bytes(big)
    store.upload(tmp_path / "big.bin", "t", "big.bin")
    assert s3_target.get("t/big.bin") == big and store.size("t", "big.bin") == len(big)
    store.download(tmp_path / "back" / "big.bin", "t", "big.bin")
    assert (tmp_path / "back" / "big.bin").read_bytes() == big
    store.remove("t", recursive=True)
    assert s3_target.keys() == []

    started = time.monotonic()
    with pytest.raises(FileNotFoundError):  # permanent: no retry
        store.read_bytes("t", "missing.json")
    assert time.monotonic() - started < 1.0

    # Endpoint down: retried with backoff, then one clear error naming the object and the attempts.
    s3_target.proxy.stop()
    started = time.monotonic()
    with pytest.raises(StorageError, match=rf"put {s3_target.root}/t/z\.json failed after 3 attempts") as info:
        store.write_json({"z": 1}, "t", "z.json")
    assert time.monotonic() - started >= 0.1 + 0.2 * 0.5  # two backoff waits at least (jitter >= 0)
    assert is_transient(info.value.__cause__)
    s3_target.proxy.start()
    store.write_json({"z": 1}, "t", "z.json")
    assert json.loads(s3_target.get("t/z.json")) == {"z": 1}

    # Throttling (SlowDown as s3fs raises it) twice, then success: three calls, one object.
    real_pipe, calls = store.fs.pipe_file, []

    def throttled(path, data, **kw):
        calls.append(path)
        if len(calls) <= 2:
            exc = OSError(errno.EBUSY, "Please reduce your request rate.")
            exc.__cause__ = ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"
            )
            raise exc
        return real_pipe(path, data, **kw)

    monkeypatch.setattr(store.fs, "pipe_file", throttled)
    store.write_bytes(b"after throttling", "t", "w.bin")
    assert len(calls) == 3 and s3_target.get("t/w.bin") == b"after throttling"


def test_a_partitions_prompts_are_read_from_its_row_group_alone(s3_target, tmp_path):
    """Range runs read the corpus per partition: a 902K-prompt corpus (~750 MB) was fetched whole, 903
    times, by a run over every partition. Written with a row group per partition, one partition's read
    fetches its group (ranged GETs) and returns exactly the rows a whole read and a filter give."""
    from dflash_assets.stages.completions.tables import load_range_prompts

    store = resolved(storage_resource(s3_target, tmp_path)).open()
    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghij"), 6)) for _ in range(2000)])
    corpus = pl.DataFrame(
        [
            {
                "index": i,
                "prompt_id": f"p{i}",
                "source": "s",
                "messages": [{"role": "user", "content": " ".join(rng.choice(words, 300))}],
                "content_hash": f"{i:x}",
                "file": "f.jsonl",
                "line": i,
            }
            for i in range(4000)
        ],
        schema=CORPUS_SCHEMA,
    )
    store.write_parquet(corpus, *CORPUS_FILE, row_group_size=200)
    size = store.size(*CORPUS_FILE)
    assert size > 3_000_000  # random words: zstd cannot shrink it to a few blocks

    s3_target.proxy.bytes_from_upstream = 0
    one = load_range_prompts(store, ["0000600-0000799"])["0000600-0000799"]
    fetched = s3_target.proxy.bytes_from_upstream
    assert one.equals(corpus.filter(pl.col("index").is_between(600, 799)))
    assert fetched < size / 5, f"{fetched} bytes fetched for 1 of 20 row groups of a {size}-byte file"

    parts = load_range_prompts(store, ["0000000-0000199", "0003800-0003999"])
    assert parts["0003800-0003999"].equals(corpus.slice(3800, 200)) and parts["0000000-0000199"].equals(
        corpus.head(200)
    )
    only = store.read_parquet(*CORPUS_FILE, columns=["line"], index_ranges=[(10, 12), (3999, 5000)])
    assert only["line"].to_list() == [10, 11, 12, 3999]
    # stable indices leave gaps: a range partly past the corpus is its prompts; one with none is an error
    assert load_range_prompts(store, ["0003900-0004099"])["0003900-0004099"].equals(corpus.slice(3900, 100))
    with pytest.raises(dg.Failure, match="partition 0004000-0004199: the corpus holds no prompt in this index range"):
        load_range_prompts(store, ["0004000-0004199"])


def test_check_reports_missing_bucket(s3_target, tmp_path):
    resolved(storage_resource(s3_target, tmp_path)).check()
    missing = resolved(storage_resource(s3_target, tmp_path, root="s3://no-such-bucket-dflash/x"))
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-dflash' is not usable"):
        missing.check()


# -- journal sync -------------------------------------------------------------------------------


def wait_for(predicate, timeout_s: float = 10.0, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def test_journal_segments_sync_seed_merge_and_discard(s3_target, tmp_path):
    resource = resolved(storage_resource(s3_target, tmp_path / "scratch", journal_sync_rows=3, journal_sync_s=60))
    parts = ("completions", "p.journal.jsonl")
    journal = resource.open_journal(*parts)
    assert isinstance(journal, SyncedRowJournal)
    seg_dir = "completions/p.journal/"
    for i in range(3):
        journal.append({"index": i, "v": "first"})
    assert wait_for(lambda: len(s3_target.keys(seg_dir)) == 1)  # row trigger
    journal.append_many([{"index": 3}, {"index": 4}])
    time.sleep(0.3)
    assert len(s3_target.keys(seg_dir)) == 1  # 2 rows < 3 and 60 s not reached
    journal.close()  # clean stop: pending rows synced
    keys = s3_target.keys(seg_dir)
    writer = writer_identity()  # segment names carry the writer: two hosts never share one
    assert keys == [seg_dir + f"seg-000001-{writer}.jsonl", seg_dir + f"seg-000002-{writer}.jsonl"]
    assert b"".join(s3_target.get(k) for k in keys) == journal.path.read_bytes()

    # time trigger
    timed = resolved(
        storage_resource(s3_target, tmp_path / "scratch", journal_sync_rows=100, journal_sync_s=0.2)
    ).open_journal(*parts)
    timed.append({"index": 5})
    assert wait_for(lambda: len(s3_target.keys(seg_dir)) == 3, timeout_s=5)
    timed.close()

    # empty disk: rebuilt from the segments
    shutil.rmtree(tmp_path / "scratch")
    fresh = resource.open_journal(*parts)
    assert sorted(fresh.load()) == [0, 1, 2, 3, 4, 5]
    assert fresh.path.read_bytes() == b"".join(s3_target.get(k) for k in s3_target.keys(seg_dir))
    fresh.close()

    def put_segment(name: str, body: bytes) -> None:
        s3_target.client.put_object(Bucket=s3_target.bucket, Key=f"{s3_target.prefix}/{seg_dir}{name}", Body=body)

    # another machine carried on from these rows: the local copy is a prefix and is brought up to date
    put_segment("seg-000004.jsonl", b'{"index":6,"v":"other"}\n')
    carried = resource.open_journal(*parts)
    assert sorted(carried.load()) == [0, 1, 2, 3, 4, 5, 6] and len(s3_target.keys(seg_dir)) == 4
    carried.close()

    # diverged: another machine synced rows 7 and 0 while this one holds local-only rows 9 and 0
    carried.append_many_local([{"index": 9, "v": "local"}, {"index": 0, "v": "local"}])
    put_segment("seg-000005.jsonl", b'{"index":7,"v":"other"}\n{"index":0,"v":"other"}\n')
    merged = resource.open_journal(*parts)
    rows = merged.load()
    assert sorted(rows) == [0, 1, 2, 3, 4, 5, 6, 7, 9] and rows[0]["v"] == "local" and rows[7]["v"] == "other"
    union = seg_dir + f"seg-000006-{writer}.jsonl"
    assert s3_target.keys(seg_dir) == [union]  # union uploaded, then its parts removed
    assert s3_target.get(union) == merged.path.read_bytes()
    merged.discard()
    assert s3_target.keys("completions/") == [] and not merged.path.exists()


# -- the pipeline on S3 -------------------------------------------------------------------------


@pytest.mark.slow
def test_corpus_completions_tokenized_on_s3(s3_target, s3_env, local_inference, tmp_path, caplog, capfd):
    write_prompts(tmp_path / "prompts.jsonl", 2)
    storage = storage_resource(s3_target, tmp_path / "scratch")
    pk = "0000000-0000001"
    with dg.instance_for_test() as instance:
        materialize_corpus(instance, storage, tmp_path / "prompts.jsonl", partition_size=2)
        assert instance.get_dynamic_partitions(prompt_ranges.name) == [pk]
        resources = {
            "storage": storage,
            "inference": local_inference,
            "generation": GenerationResource(max_output_tokens=8),
            "target_model": TargetModelResource(),
        }
        result = dg.materialize(
            [completions, tokenized_sequences],
            partition_key=pk,
            instance=instance,
            resources=resources,
            selection=[completions, tokenized_sequences],
            # cap-length rows all supervise the same few tokens: keep them, and relax the degenerate-mode check
            run_config={
                "ops": {"tokenized_sequences": {"config": {"truncated": "keep", "degenerate_small_tokens": 1}}}
            },
        )
        assert result.success
        logs = event_log_text(instance)
    keys = s3_target.keys()
    assert keys == sorted(
        [
            "prompt_corpus/corpus.parquet",
            "prompt_corpus/rejected.parquet",
            f"completions/{pk}.parquet",
            # the stable-index table and the partition ranges, beside the corpus (issue 26)
            "prompt_corpus/prompt_index.parquet",
            "prompt_corpus/partition_ranges.json",
            f"tokenized_sequences/{pk}.parquet",
            f"tokenized_sequences/{pk}.set_aside.parquet",
        ]
    )  # no journal segments left, nothing else
    store = resolved(storage).open()
    rows = store.read_parquet("completions", f"{pk}.parquet")
    assert rows["index"].to_list() == [0, 1] and rows["error"].to_list() == [None, None]
    assert all(0 < n <= 8 for n in rows["completion_tokens"].to_list())
    tok = store.read_parquet("tokenized_sequences", f"{pk}.parquet")
    assert tok["index"].to_list() == [0, 1]
    assert tok["num_loss_tokens"].to_list() == [sum(m) for m in tok["loss_mask"].to_list()]
    assert not (tmp_path / "scratch" / s3_target.bucket / "run" / "completions" / f"{pk}.journal.jsonl").exists()
    assert f"{s3_target.root}/completions/{pk}.parquet" in logs  # metadata paths are the S3 URIs
    out, err = capfd.readouterr()
    assert_no_credentials(s3_env, logs, caplog.text, out, err)


# -- kill -9 mid-partition, empty scratch, resume from storage ----------------------------------

CHILD = r"""
import json, sys
import dagster as dg
from dflash_assets.assets.completions import completions
from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
cfg = json.loads(sys.argv[1])
instance = dg.DagsterInstance.ephemeral()
instance.add_dynamic_partitions(prompt_ranges.name, [cfg["pk"]])
storage = StorageResource(aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
                          aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"), **cfg["storage"])
inference = InferenceServerResource(mode="external", base_urls=[cfg["url"]], served_model_name="fake",
                                    max_running_requests=2)
print("CHILD STARTED", flush=True)
resources = {"storage": storage, "inference": inference, "generation": GenerationResource(max_output_tokens=16),
             "target_model": TargetModelResource()}
dg.materialize([completions], partition_key=cfg["pk"], instance=instance, resources=resources)
"""


def test_kill9_mid_partition_then_resume_on_empty_scratch(s3_target, s3_env, tmp_path, caplog):
    n = 40
    texts = write_prompts(tmp_path / "prompts.jsonl", n)
    scratch = tmp_path / "scratch"
    storage = storage_resource(s3_target, scratch, journal_sync_rows=4, journal_sync_s=0.3)
    pk = f"0000000-{n - 1:07d}"
    with FakeServer(Reply(delay_s=0.12)) as server, dg.instance_for_test() as instance:
        write_corpus_direct(instance, storage, tmp_path / "prompts.jsonl", partition_size=n)
        cfg = {
            "pk": pk,
            "url": f"{server.url}/v1",
            "storage": dict(
                root=s3_target.root,
                scratch_dir=str(scratch),
                endpoint_url=s3_target.endpoint_url,
                region="us-east-1",
                journal_sync_rows=4,
                journal_sync_s=0.3,
                retry_attempts=3,
                retry_backoff_s=0.1,
            ),
        }
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
        try:
            assert wait_for(
                lambda: len(remote_journal_rows(s3_target, pk)) >= 8 or child.poll() is not None,
                timeout_s=90,
                every_s=0.05,
            )
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
        child_out = child.stdout.read().decode()
        synced = set(remote_journal_rows(s3_target, pk))
        first_run = requested_prompts(server, texts)
        assert 8 <= len(synced) < n and synced <= set(first_run)
        assert not s3_target.keys(f"completions/{pk}.parquet")

        shutil.rmtree(scratch)  # a machine with an empty local disk
        before = len(requested_prompts(server, texts))
        result = dg.materialize(
            [completions],
            partition_key=pk,
            instance=instance,
            resources={
                "storage": storage,
                "inference": fake_inference(server),
                "target_model": TargetModelResource(),
                "generation": GenerationResource(max_output_tokens=16),
            },
        )
        assert result.success
        second_run = requested_prompts(server, texts)[before:]
        logs = event_log_text(instance)
    assert not synced & set(second_run)  # rows synced before the kill are not requested again
    assert sorted(second_run) == sorted(set(range(n)) - synced)  # and every other prompt exactly once
    table = resolved(storage).open().read_parquet("completions", f"{pk}.parquet")
    assert table["index"].to_list() == list(range(n))  # every prompt exactly once
    assert table.filter(pl.col("error").is_not_null()).height == 0
    assert s3_target.keys(f"completions/{pk}.journal/") == []
    assert_no_credentials(s3_env, logs, child_out, caplog.text)


# -- endpoint outage mid-run ----------------------------------------------------------------------


@pytest.mark.parametrize("outage", ["short", "until_end"])
def test_endpoint_outage_mid_run(s3_target, s3_env, tmp_path, outage, caplog):
    """short: the endpoint is down 1 s while rows finish; the run recovers (background syncs retry).
    until_end: it is still down at the final sync; the run fails with a StorageError naming the object,
    and after the endpoint is back a rerun completes without requesting any prompt again."""
    n = 24
    texts = write_prompts(tmp_path / "prompts.jsonl", n)
    storage = storage_resource(s3_target, tmp_path / "scratch", journal_sync_rows=3, journal_sync_s=0.2)
    pk = f"0000000-{n - 1:07d}"
    outage_ends = [0.0]
    # short: requests that arrive during the outage are answered just after it, so rows are still
    # coming when the endpoint is back (the run must recover); rows in flight finish during it.

    def script(i: int, body: dict) -> Reply:
        return Reply(delay_s=max(0.08, outage_ends[0] - time.monotonic() + 0.1))

    with FakeServer(script) as server, dg.instance_for_test() as instance:
        write_corpus_direct(instance, storage, tmp_path / "prompts.jsonl", partition_size=n)
        synced_before: set[int] = set()

        def outage_thread() -> None:
            wait_for(lambda: len(remote_journal_rows(s3_target, pk)) >= 6, timeout_s=30)
            synced_before.update(remote_journal_rows(s3_target, pk))
            if outage == "short":
                outage_ends[0] = time.monotonic() + 1.0
            s3_target.proxy.stop()
            if outage == "short":
                time.sleep(1.0)
                s3_target.proxy.start()

        thread = threading.Thread(target=outage_thread, daemon=True)
        thread.start()
        resources = {
            "storage": storage,
            "inference": fake_inference(server),
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=16),
        }
        first = dg.materialize(
            [completions], partition_key=pk, instance=instance, resources=resources, raise_on_error=False
        )
        thread.join(30)
        assert len(synced_before) >= 6
        if outage == "short":
            assert first.success  # recovered
        else:
            assert not first.success
            error = first.get_step_failure_events()[0].event_specific_data.error.to_string()
            assert "StorageError" in error and f"put {s3_target.root}/completions/{pk}.journal/seg-" in error
            assert "failed after 3 attempts" in error
            assert not s3_target.proxy.running
            assert set(remote_journal_rows(s3_target, pk)) >= synced_before  # nothing synced was lost
            s3_target.proxy.start()
            second = dg.materialize([completions], partition_key=pk, instance=instance, resources=resources)
            assert second.success
        logs = event_log_text(instance)
    requests = requested_prompts(server, texts)
    assert sorted(requests) == list(range(n))  # each prompt requested exactly once over both runs
    table = resolved(storage).open().read_parquet("completions", f"{pk}.parquet")
    assert table["index"].to_list() == list(range(n))
    assert s3_target.keys(f"completions/{pk}.journal/") == []
    assert_no_credentials(s3_env, logs, caplog.text)


def test_drafter_inputs_download_to_empty_scratch(s3_target, tmp_path):
    """complete_shards / ensure_local_dir fetch what a fresh machine lacks: complete partitions' shards
    (by the sizes their index records), the drafter export; incomplete or absent partitions are skipped."""
    from dflash_assets.stages.drafter.run import EXPORT_DIR
    from dflash_assets.stages.stored_inputs import complete_shards

    resource = resolved(storage_resource(s3_target, tmp_path / "scratch"))
    store = resource.open()
    shard_a, shard_b = os.urandom(1000), os.urandom(2000)
    store.write_bytes(shard_a, "hidden_states", "p0", "shard-00000.safetensors")
    store.write_bytes(shard_b, "hidden_states", "p0", "shard-00001.safetensors")
    store.write_json(
        {
            "complete": True,
            "shards": [
                {"name": "shard-00000.safetensors", "bytes": 1000},
                {"name": "shard-00001.safetensors", "bytes": 2000},
            ],
        },
        "hidden_states",
        "p0",
        "index.json",
    )
    store.write_json({"complete": False, "shards": []}, "hidden_states", "p1", "index.json")
    store.write_bytes(b'{"block_size": 16}', *EXPORT_DIR, "config.json")
    store.write_bytes(b"weights", *EXPORT_DIR, "model.safetensors")

    # a stale, truncated local copy of shard 1 is replaced (size differs from the index)
    stale = resource.local_scratch("hidden_states", "p0", "shard-00001.safetensors")
    Path(stale).write_bytes(shard_b[:10])
    shards, used, skipped = complete_shards(resource, ["p0", "p1", "p2"])
    assert used == ["p0"] and skipped == ["p1", "p2"]
    assert [Path(s).read_bytes() for s in shards] == [shard_a, shard_b]
    assert all(s.startswith(str(tmp_path / "scratch" / s3_target.bucket / "run")) for s in shards)
    export = resource.ensure_local_dir(*EXPORT_DIR)
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]
    assert Path(export, "model.safetensors").read_bytes() == b"weights"
