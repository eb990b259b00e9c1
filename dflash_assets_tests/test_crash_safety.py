"""Issue 32 finding 8: what a crash or a failure leaves behind. The export and S3 downloads are fsynced
(file, then directory) before and after their renames; the drafter's weights are hashed and counted
streamed; a failed final journal sync does not hide the error that ended the run."""

from __future__ import annotations

import gc
import json
import os
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from dflash_assets.dflash.export.directory import export_drafter

try:
    from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target
    from dflash_assets_tests.test_dflash_export import make_model
    from dflash_assets_tests.test_shared_store import s3_storage
except ImportError:
    from s3_fixtures import moto_server, s3_env, s3_target  # type: ignore[no-redef]  # noqa: F401
    from test_dflash_export import make_model  # type: ignore[no-redef]
    from test_shared_store import s3_storage  # type: ignore[no-redef]


@pytest.fixture(autouse=True)
def _collect_garbage_now():
    """Collect what a test left (s3fs sessions, a failed run's frames) before the next test: collected
    later, during an unrelated ``ast.parse``, they trip CPython 3.11.7's "AST constructor recursion depth
    mismatch" SystemError (seen in test_layout when it ran after these tests and test_stale_outputs)."""
    yield
    gc.collect()


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """Paths os.fsync was called on (what each descriptor named at the time), in order."""
    calls: list[str] = []
    real = os.fsync

    def spy(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_export_fsyncs_its_files_and_directories_around_each_rename(tmp_path, fsynced):
    out = export_drafter(make_model(), tmp_path / "export")
    version = out.resolve()
    versions = version.parent
    staged = [p for p in fsynced if Path(p).parent.name.startswith(".tmp-")]
    assert {Path(p).name for p in staged} == {"model.safetensors", "config.json"}  # the files, before renaming
    assert any(Path(p).name.startswith(".tmp-") and Path(p).parent == versions for p in fsynced)  # their dir
    assert str(versions) in fsynced  # the version's rename
    assert str(tmp_path) in fsynced  # the link switch
    assert fsynced.index(str(tmp_path)) > fsynced.index(str(versions)) > fsynced.index(staged[0])


def test_s3_download_fsyncs_the_file_before_the_rename_and_the_directory_after(s3_target, tmp_path, fsynced):
    storage = s3_storage(s3_target, tmp_path / "scratch")
    store = storage.open()
    store.write_bytes(b"w" * 5000, "dflash_drafter", "export", "model.safetensors")
    local = tmp_path / "local" / "model.safetensors"
    fsynced.clear()
    store.download(local, "dflash_drafter", "export", "model.safetensors", size=5000)
    assert local.read_bytes() == b"w" * 5000
    assert any(Path(p).name.startswith(".model.safetensors.") and Path(p).name.endswith(".tmp") for p in fsynced)
    assert fsynced[-1] == str(local.parent)


def test_drafter_weights_are_counted_and_hashed_without_reading_them_whole(tmp_path):
    """64 MB of weights: publishing and counting them must not hold them in memory (the recipe's are 3.5 GB)."""
    from dflash_assets.stages.drafter.identity import file_sha256
    from dflash_assets.stages.drafter.report import count_params
    from dflash_assets.stages.drafter.run import publish_export
    from dflash_assets.storage.store import Storage

    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    save_file({"fc.weight": torch.zeros(4096, 4096), "norm.weight": torch.ones(7)}, str(export / "model.safetensors"))
    store = Storage(str(tmp_path / "root"))
    tracemalloc.start()
    try:
        weights = publish_export(store, str(export), b"")
        params = count_params(weights)
        digest = file_sha256(weights) if isinstance(weights, str) else None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert params == 4096 * 4096 + 7
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB while publishing 64 MiB of weights"
    assert digest is not None and len(digest) == 64


def test_count_params_names_a_file_that_is_not_safetensors(tmp_path):
    from dflash_assets.stages.drafter.report import count_params

    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        count_params(str(bad))


def test_failed_final_journal_sync_keeps_the_original_error_and_reports_the_sync(s3_target, tmp_path):
    """The servers fail to start while S3 is down and the journal holds unsynced rows: the run's error
    is the servers' one, and the failed sync is logged and noted on it."""
    from dflash_assets.common.settings import GenerationSettings
    from dflash_assets.stages.completions.range_run import RangeRun

    storage = s3_storage(s3_target, tmp_path / "scratch")
    pk = "0000000-0000009"
    journal_file = storage.local_scratch("completions", f"{pk}.journal.jsonl")
    Path(journal_file).write_text(json.dumps({"index": 3, "answer": "kept locally"}) + "\n")
    logged: list[str] = []
    log = SimpleNamespace(info=logged.append, warning=logged.append, error=logged.append)
    run = RangeRun(log, storage.open(), GenerationSettings(max_output_tokens=16), [pk])

    def plan(pk, prompts, journal, inference):
        s3_target.proxy.stop()  # storage goes down after the journal was opened
        return SimpleNamespace(pk=pk, todo=[3], journal=journal)

    def serve(**kwargs):
        raise RuntimeError("SGLang server 0 exited with code 1")

    run.plan = plan
    try:
        with pytest.raises(RuntimeError) as err:
            list(run.run({pk: None}, storage, SimpleNamespace(serve=serve, mode="local")))
    finally:
        s3_target.proxy.start()
    assert "SGLang server 0 exited with code 1" in str(err.value)
    reported = "\n".join(logged + list(getattr(err.value, "__notes__", [])))
    assert "final journal sync failed" in reported and f"{pk}.journal" in reported
    assert json.loads(Path(journal_file).read_text())["answer"] == "kept locally"
