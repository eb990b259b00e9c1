"""``drafter_evaluation`` in engine mode against the GPU-node simulator (``dflash_simulators.sglang_stub``, its own
process speaking HTTP, started by the real SGLang launcher code): tau per dataset is what the engine's
per-request fields say (checked against the simulator's own request log), the server flags are SGLang's
DFLASH flags and land in the metadata without the API key, a simulated engine is labelled so and kept apart
from measured figures, and an export SGLang would refuse is refused with the reason before any server starts.

The simulator stands in only for SGLang on a GPU (not installable here); the asset, the launcher, the client,
the export and the check are the real ones. The target is a Qwen3.6-shaped config.json (hybrid layers)
beside a real tokenizer with a thinking chat template; no target weights are needed with ``in_process: false``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import httpx
import polars as pl
import pytest

from dflash_assets.app.summary_lines import engine_line
from dflash_assets.assets.evaluation import drafter_evaluation
from dflash_assets.dflash.shards.dataset import heldout_fraction_of
from dflash_assets.generation.processes.ports import free_port_block
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets_tests.test_completions_asset import write_corpus
from dflash_assets_tests.test_engine_check import edit_tensors, make_export, write_target_config

STUB = "dflash_simulators.sglang_stub"
KEY = "sk-engine-test-4242"
SIM = [
    "--sim-startup-s",
    "20",
    "--sim-median-tokens",
    "40",
    "--sim-sigma",
    "0.6",
    "--sim-speed",
    "50",
    "--sim-accept-p",
    "0.7",
]
EVAL_FRACTION = 0.5
PROMPTS = [f"prompt {i}: write a function number {i}" for i in range(16)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A real tokenizer (SmolLM2's, with <think> and a thinking template) beside a Qwen3.6-shaped config."""
    from dflash_simulators.thinking_tokenizer import write_thinking_tokenizer

    directory = tmp_path_factory.mktemp("engine") / "target"
    write_thinking_tokenizer(directory, opens_think=True)
    write_target_config(directory)  # config.json only: the tokenizer stays SmolLM2's (vocab 49,154 < 49,280)
    return directory


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))


def setup_pipeline(instance, root: Path, corpus: bool = True) -> None:
    """What drafter_evaluation reads: the corpus, tokenized rows (the held-out split is a hash of the index),
    the drafter's export and its materialization (``corpus=False``: the export and the materialization only)."""
    keys = write_corpus(instance, root, PROMPTS, partition_size=8) if corpus else []
    for pk in keys:
        first = int(pk.split("-")[0])
        rows = [
            {"index": i, "input_ids": list(range(5, 25)), "loss_mask": [0] * 5 + [1] * 15}
            for i in range(first, first + 8)
        ]
        (root / "tokenized_sequences").mkdir(parents=True, exist_ok=True)
        pl.DataFrame(rows).write_parquet(root / "tokenized_sequences" / f"{pk}.parquet")
    make_export(root / "dflash_drafter" / "export")
    instance.report_runless_asset_event(
        dg.AssetMaterialization(
            asset_key="dflash_drafter",
            metadata={
                "features": "online",
                "eval_fraction": EVAL_FRACTION,
                "max_length": 3072,
                "seed": 0,
                "data_fingerprint": "d0",
            },
        )
    )


def held_out_count() -> int:
    return sum(heldout_fraction_of(f"idx:{i}") < EVAL_FRACTION for i in range(len(PROMPTS)))


def stub_inference(tmp_path: Path, target_dir: Path, servers: int = 2) -> InferenceServerResource:
    return InferenceServerResource(
        mode="sglang",
        model_path=str(target_dir),
        num_servers=servers,
        max_running_requests=4,
        port_base=free_port_block(servers),
        launch_module=STUB,
        startup_timeout_s=60.0,
        api_key=KEY,
        extra_args=[
            *SIM,
            "--sim-starts-file",
            str(tmp_path / "starts.txt"),
            "--sim-request-log",
            str(tmp_path / "requests.jsonl"),
        ],
    )


def evaluate(instance, root: Path, target_dir: Path, inference, raise_on_error: bool = True, **config):
    config = {"num_prompts": 4, "max_new_tokens": 24, "in_process": False, **config}
    return dg.materialize(
        [drafter_evaluation],
        instance=instance,
        raise_on_error=raise_on_error,
        resources={
            "storage": StorageResource(root=str(root)),
            "target_model": TargetModelResource(model_path=str(target_dir)),
            "inference": inference,
        },
        run_config={"ops": {"drafter_evaluation": {"config": config}}},
    )


def metadata_of(result) -> dict:
    return {
        k: getattr(v, "value", v)
        for k, v in result.asset_materializations_for_node("drafter_evaluation")[0].metadata.items()
    }


def stub_log(path: Path) -> dict[str, dict]:
    """The simulator's own record of each /generate request it finished, by input_sha."""
    out = {}
    for e in map(json.loads, path.read_text().splitlines()):
        if e["ev"] == "done" and "spec_verify_ct" in e:
            assert e["key"] not in out, f"request {e['key']} answered twice"
            out[e["key"]] = e
    return out


def test_engine_mode_reports_tau_per_dataset_from_the_engines_fields_labelled_simulated(tmp_path, target_dir, registry):
    root = tmp_path / "data"
    extra = tmp_path / "extra_set.jsonl"
    extra.write_text("".join(json.dumps({"prompt": f"an unseen task {i}"}) + "\n" for i in range(3)))
    with dg.instance_for_test() as instance:
        setup_pipeline(instance, root)
        result = evaluate(
            instance,
            root,
            target_dir,
            stub_inference(tmp_path, target_dir),
            engine="sglang",
            prompt_files=[str(extra)],
            draft_attention_backend="fa3",
        )
        meta = metadata_of(result)
        logs = "\n".join(str(e.user_message) for e in instance.all_logs(result.run_id))
    report = json.loads((root / "drafter_evaluation" / "report.json").read_text())
    engine = report["engine"]
    seen = stub_log(tmp_path / "requests.jsonl")
    # every prompt once, on the simulator; datasets as the in-process evaluation builds them
    assert sorted(r["input_sha"] for r in engine["requests"]) == sorted(seen)
    sizes = {name: sum(r["dataset"] == name for r in engine["requests"]) for name in engine["datasets"]}
    assert sizes == {"heldout": min(4, held_out_count()), "extra_set": 3}
    for name, d in engine["datasets"].items():
        logged = [seen[r["input_sha"]] for r in engine["requests"] if r["dataset"] == name]
        mean = sum(e["spec_accept_length"] for e in logged) / len(logged)
        pooled = sum(e["tokens"] for e in logged) / sum(
            e["spec_verify_ct"] for e in logged
        )  # completion_tokens / verify steps
        assert d["tau"] == pytest.approx(mean, rel=1e-12) and d["tau_pooled"] == pytest.approx(pooled, rel=1e-12)
        bare = sum((e["tokens"] - 1) / e["spec_verify_ct"] for e in logged) / len(logged)
        assert d["tau_without_prefill_token"] == pytest.approx(bare, rel=1e-12)
        assert 1.0 < d["tau"] <= 4.0  # block 4: the bonus token and at most 3 drafts per step
        assert meta["simulated_engine_tau_by_dataset"][name]["tau"] == round(mean, 4)
    # simulated: labelled, under simulated_* keys, never the measured keys nor beside the in-process figure
    assert meta["engine_simulated"] is True and engine["simulated"] is True
    assert "SIMULATED" in meta["engine_label"] and "not a measurement" in meta["engine_label"]
    assert "engine_tau" not in meta and "engine_tau_by_dataset" not in meta and "tau" not in meta
    assert "SIMULATED" in meta["engine_table"] and "in-process" not in meta["engine_table"]
    assert all(info["simulated"] is True for info in engine["server_info"])
    # SGLang's DFLASH flags, the mamba strategy chosen from the target's hybrid layer_types, the key only by name
    # (in a private --config file, never on the command line)
    flags = meta["engine_server_flags"]
    assert len(flags) == 2
    export = str(root / "dflash_drafter" / "export")
    for line in flags:
        for part in (
            "--speculative-algorithm DFLASH",
            f"--speculative-draft-model-path {export}",
            "--speculative-num-draft-tokens 4",
            "--speculative-draft-attention-backend fa3",
            "--mamba-radix-cache-strategy extra_buffer",
            "--config '<0600 file: api-key: $DFLASH_SERVER_API_KEY>'",
        ):
            assert part in line, (part, line)
    assert engine["server_info"][0]["speculative_num_draft_tokens"] == 4
    # the key is in no metadata, report, log line or server log (the simulator prints its arguments, key included)
    server_logs = "".join(p.read_text() for p in (root / "server_logs").rglob("*.log"))
    assert "server_args=" in server_logs
    for text in (json.dumps(meta, default=str), json.dumps(report), logs, server_logs):
        assert KEY not in text
    assert len((tmp_path / "starts.txt").read_text().splitlines()) == 2


def test_an_export_sglang_would_refuse_is_refused_before_any_server_starts(tmp_path, target_dir, registry):
    def break_tensor(export: Path) -> None:
        edit_tensors(export, lambda t: t.update({"proj.weight": t.pop("fc.weight")}))

    def break_mask(export: Path) -> None:
        config = json.loads((export / "config.json").read_text())
        config["dflash_config"]["mask_token_id"] = 49280
        (export / "config.json").write_text(json.dumps(config))

    cases = [
        (break_tensor, "tensors SGLang would skip silently (no DFlashDraftModel parameter of that name): proj.weight"),
        (break_mask, "mask_token_id 49280 >= the target's vocab_size 49280"),
    ]
    with dg.instance_for_test() as instance:
        for i, (breakage, reason) in enumerate(cases):
            root = tmp_path / f"data{i}"
            setup_pipeline(instance, root, corpus=False)  # refused before the corpus would even be read
            breakage(root / "dflash_drafter" / "export")
            result = evaluate(
                instance, root, target_dir, stub_inference(tmp_path, target_dir), raise_on_error=False, engine="sglang"
            )
            assert not result.success
            failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
            text = str(failure.event_specific_data.error)
            assert "refused before any server started" in text and reason in text and "fix:" in text
            assert not (tmp_path / "starts.txt").exists() and not (tmp_path / "requests.jsonl").exists()
            assert not (root / "server_logs").exists() and not (root / "drafter_evaluation").exists()


class StubProcess:
    """The simulator started by hand, as an external engine someone else runs."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr = tmp_path / f"stub_{self.port}.err"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", STUB, "--port", str(self.port), "--sim-startup-s", "0", *args],
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.stderr.read_text())
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("stub did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_external_engine_and_the_simulators_own_refusals(tmp_path, target_dir, registry):
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        setup_pipeline(instance, root)
        export = root / "dflash_drafter" / "export"
        flags = [
            "--model-path",
            str(target_dir),
            "--speculative-algorithm",
            "DFLASH",
            "--speculative-draft-model-path",
            str(export),
            "--speculative-num-draft-tokens",
            "4",
            "--sim-request-log",
            str(tmp_path / "requests.jsonl"),
        ]
        # the simulator refuses at start-up what SGLang refuses: a flag 0.5.20 dropped, an export with a skipped name
        old = StubProcess(tmp_path, *flags, "--mamba-scheduler-strategy", "extra_buffer")
        assert (
            old.proc.wait(timeout=30) == 1
            and "unrecognized arguments: --mamba-scheduler-strategy" in old.stderr.read_text()
        )
        stub = StubProcess(tmp_path, *flags)
        try:
            stub.wait_ready()
            result = evaluate(
                instance, root, target_dir, InferenceServerResource(), engine="external", engine_base_urls=[stub.url]
            )
        finally:
            stub.stop()
        meta = metadata_of(result)
    seen = stub_log(tmp_path / "requests.jsonl")
    assert (
        meta["engine_kind"] == "external" and meta["engine_simulated"] is True and meta["engine_requests"] == len(seen)
    )
    expected = sum(e["spec_accept_length"] for e in seen.values()) / len(seen)
    assert meta["simulated_engine_tau"] == round(expected, 4)
    edit_tensors(
        export, lambda t: t.update({"layers.0.self_attn.qkv.weight": t.pop("layers.0.self_attn.q_proj.weight")})
    )
    refused = StubProcess(tmp_path, *flags)
    assert refused.proc.wait(timeout=30) == 1
    err = refused.stderr.read_text()
    assert "layers.0.self_attn.qkv.weight" in err and "tensors missing: layers.0.self_attn.q_proj.weight" in err


def test_the_summary_never_shows_a_simulated_engine_figure_as_a_measurement():
    simulated = {
        "engine_kind": "sglang",
        "engine_simulated": True,
        "engine_requests": 7,
        "simulated_engine_tau": 2.5,
        "simulated_engine_tau_pooled": 2.4,
    }
    line = engine_line(simulated)
    assert line.startswith("engine (SIMULATED)") and "not a measurement" in line and "simulated tau 2.5" in line
    real = {
        "engine_kind": "sglang",
        "engine_simulated": False,
        "engine_requests": 64,
        "engine_tau": 6.1,
        "engine_tau_stderr": 0.2,
        "engine_tau_pooled": 6.0,
    }
    assert engine_line(real).startswith("engine tau (SGLang) 6.1 +- 0.2") and "SIMULATED" not in engine_line(real)
    assert engine_line({}) is None
