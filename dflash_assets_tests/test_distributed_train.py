"""torchrun training: 2 processes, 2 "nodes" on loopback (gloo, c10d rendezvous), kill -9 and resume.

Each run ends with the same weights as one process with the same global batch (2 rows per step). A
tiny random-init Llama target (hidden 32) keeps every run to seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import polars as pl
import pytest
import torch

from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import read_index
from dflash_assets.dflash.training.checkpoints import latest_checkpoint
from dflash_assets.dflash.training.config import TrainConfig
from dflash_assets.dflash.training.distributed import torchrun_argv, write_node_script
from dflash_assets.dflash.training.train import train

try:
    from dflash_assets_tests.tiny_target import LAYER_IDS, VOCAB, make_rows, make_target
except ImportError:
    from tiny_target import LAYER_IDS, VOCAB, make_rows, make_target  # type: ignore[no-redef]

REPO = str(Path(__file__).resolve().parents[1])
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
TOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    model, target = make_target(root)
    rows = make_rows(12)
    out = root / "hs"
    extract_partition(model, rows, out, LAYER_IDS, rows_per_shard=6, dtype=torch.bfloat16)
    shards = [str(out / s["name"]) for s in read_index(out)["shards"]]
    tok = root / "tok.parquet"
    pl.DataFrame(rows).write_parquet(tok)
    return {"target": str(target), "shards": shards, "tokenized": [str(tok)]}


def train_args(d: dict, out: Path, features: str, steps: int, batch_size: int, checkpoint_every: int = 5) -> list[str]:
    inputs = ["--shards", *d["shards"]] if features == "offline" else ["--tokenized", *d["tokenized"]]
    return [
        *inputs,
        "--features",
        features,
        "--out",
        str(out),
        "--target-model",
        d["target"],
        "--num-hidden-layers",
        "1",
        "--block-size",
        "4",
        "--mask-token-id",
        str(VOCAB - 1),
        "--max-anchors",
        "4",
        "--batch-size",
        str(batch_size),
        "--lr",
        "3e-3",
        "--max-steps",
        str(steps),
        "--checkpoint-every",
        str(checkpoint_every),
        "--eval-fraction",
        "0",
        "--log-every",
        "1",
        "--seed",
        "11",
        "--device",
        "cpu",
        "--target-layer-ids",
        ",".join(map(str, LAYER_IDS)),
        "--draft-overrides",
        "{}",
    ]


def reference(d: dict, out: Path, features: str, steps: int) -> dict:
    """One process, global batch 2, same thread count as the workers."""
    cfg = TrainConfig(
        shards=d["shards"] if features == "offline" else [],
        tokenized=d["tokenized"] if features == "online" else [],
        features=features,
        out_dir=str(out),
        target_model_path=d["target"],
        num_hidden_layers=1,
        num_context_features=len(LAYER_IDS),
        target_layer_ids=LAYER_IDS,
        block_size=4,
        mask_token_id=VOCAB - 1,
        max_anchors=4,
        batch_size=2,
        lr=3e-3,
        max_steps=steps,
        checkpoint_every=0,
        eval_fraction=0.0,
        log_every=1,
        seed=11,
        device="cpu",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(cfg)
    finally:
        torch.set_num_threads(threads)
    return {"losses": [r["loss"] for r in result.records], "state": result.model.state_dict()}


def descendants(pid: int) -> list[int]:
    """Every descendant process id of ``pid`` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def final_state(out: Path) -> dict:
    return torch.load(latest_checkpoint(out), map_location="cpu", weights_only=False)["model"]


def log_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def assert_same(ref: dict, out: Path, steps: int) -> None:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["step"] == steps
    assert len(set(summary["rank_param_checksums"])) == 1  # the two replicas agree bit for bit
    losses = log_losses(out)
    assert len(losses) == steps
    assert max(abs(a - b) for a, b in zip(ref["losses"], losses)) <= TOL
    state = final_state(out)
    worst = max(float((ref["state"][k].float() - state[k].float()).abs().max()) for k in ref["state"])
    assert worst <= TOL, worst
    assert ref["losses"][-1] < ref["losses"][0]


def test_torchrun_two_processes_online_equals_one_process(data, tmp_path):
    """2 processes x 1 row, each with its own frozen target replica (online), = 1 process x 2 rows."""
    steps = 20
    ref = reference(data, tmp_path / "ref", "online", steps)
    out = tmp_path / "ddp"
    argv = torchrun_argv(train_args(data, out, "online", steps, batch_size=1), nproc_per_node=2)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["features"] == "online"
    assert_same(ref, out, steps)


def test_two_nodes_on_loopback_c10d_equal_one_process(data, tmp_path):
    """2 "nodes" x 1 process joined by a c10d rendezvous on 127.0.0.1 (gloo) = 1 process x 2 rows."""
    steps = 20
    ref = reference(data, tmp_path / "ref", "offline", steps)
    out = tmp_path / "nodes"
    argv = torchrun_argv(
        train_args(data, out, "offline", steps, batch_size=1),
        nproc_per_node=1,
        nnodes=2,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_id="test-nodes",
    )
    script = write_node_script(tmp_path / "other_node.sh", argv, {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    second = subprocess.Popen(["sh", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        outs = [p.communicate(timeout=180)[0] for p in (first, second)]
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
    assert first.returncode == 0 and second.returncode == 0, outs[0][-2000:] + outs[1][-2000:]
    assert_same(ref, out, steps)


def test_torchrun_kill9_mid_run_then_resume_matches_uninterrupted(data, tmp_path):
    """SIGKILL to torchrun and both workers mid-run; the rerun resumes from rank 0's last checkpoint
    (every rank loads it) and ends where one uninterrupted process does."""
    steps = 120
    out = tmp_path / "killed"
    argv = torchrun_argv(train_args(data, out, "offline", steps, batch_size=1, checkpoint_every=10), nproc_per_node=2)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, start_new_session=True)
    log = out / "train_log.jsonl"
    deadline = time.time() + 150
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and log.read_text().count("\n") >= 25:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "finished before the kill: " + proc.stderr.read().decode()[-2000:]
    victims = [proc.pid, *descendants(proc.pid)]
    assert len(victims) >= 3  # torchrun and its two workers (each in its own session)
    for pid in victims:  # as if the node died: no clean-up anywhere
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert not [
        p
        for p in victims[1:]
        if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
    ]
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and int(ckpt.stem.split("_")[1]) < steps
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=ENV)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 20 <= summary["resumed_from_step"] < steps
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, steps + 1))
    assert_same(reference(data, tmp_path / "ref", "offline", steps), out, steps)


def test_torchrun_argv_multi_node_needs_an_endpoint():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_argv([], nproc_per_node=8, nnodes=2)
    argv = torchrun_argv(["--out", "x"], nproc_per_node=8, nnodes=3, rdzv_endpoint="10.0.0.1:29500", rdzv_id="job7")
    assert argv[3:8] == [
        "--nnodes=3",
        "--nproc_per_node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-id=job7",
    ]
    assert argv[-4:] == ["-m", "dflash_assets.dflash.training.train", "--out", "x"]
