"""Target hidden-state extraction and shard I/O (dflash_assets.dflash.target.features / shards).

References are computed independently with a plain ``model(..., output_hidden_states=True)`` forward
of each row alone (unpadded); the layer-id formula is checked against the values DFlash publishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dflash_assets.dflash.shards.extraction import extract_partition
from dflash_assets.dflash.shards.format import read_index, read_shard, validate_shard, write_shard
from dflash_assets.dflash.target import features as tf
from dflash_assets.dflash.target.features import (
    InsufficientDiskSpaceError,
    TargetFeatureExtractor,
    check_free_space,
    estimate_bytes,
    iter_batches_by_token_budget,
)
from dflash_assets.dflash.target.layers import default_target_layer_ids

REPO = Path(__file__).resolve().parents[1]
TINY_LAYER_IDS = [1, 3, 5]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Shared 2-core machine; also the subprocesses below use one thread, so results compare bitwise.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smol():
    from dflash_assets.generation.engines.local_model import ensure_local_model

    model = AutoModelForCausalLM.from_pretrained(ensure_local_model(), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def make_rows(lengths, vocab, seed=0, first_index=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k, n in enumerate(lengths):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        rows.append({"index": first_index + k, "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)})
    return rows


def reference_features(model, input_ids, layer_ids):
    """Plain HF forward of one unpadded row: cat of hidden_states[i + 1], as z-lab's extract_context_feature."""
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def assert_bf16_close(actual, expected):
    # bf16 keeps 8 significant bits: one rounding step is <= 2**-8 relative; batched fp32 adds ~1e-6.
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-2, atol=1e-3)


def test_default_target_layer_ids_match_dflash():
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]  # Qwen3.6-27B, from the DFlash docs
    # L=30 by hand: 1 + i * 26 / 4 = 1, 7.5, 14, 20.5, 27; Python round() is half-to-even.
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, n=1) == [15]
    with pytest.raises(ValueError):
        default_target_layer_ids(30, n=0)


def test_extractor_matches_hf_hidden_states_on_padded_batch(smol):
    layer_ids = [0, 14, 1, 29]  # any order; 29 is the last layer, which HF reports after the final norm
    rows = make_rows([5, 17, 11], smol.config.vocab_size, seed=1)
    lengths = [len(r["input_ids"]) for r in rows]
    input_ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(rows):
        input_ids[b, : lengths[b]] = torch.tensor(r["input_ids"])
        attention_mask[b, : lengths[b]] = 1
    features = TargetFeatureExtractor(smol, layer_ids)(input_ids, attention_mask, dtype=torch.bfloat16)
    assert features.shape == (3, 17, 4 * 576) and features.dtype == torch.bfloat16
    for b, r in enumerate(rows):
        expected = reference_features(smol, r["input_ids"], layer_ids)
        assert_bf16_close(features[b, : lengths[b]], expected)
    # float32 output agrees with the reference far below bf16 resolution: the padding changed nothing.
    exact = TargetFeatureExtractor(smol, layer_ids)(input_ids, attention_mask, dtype=torch.float32)
    torch.testing.assert_close(
        exact[0, :5], reference_features(smol, rows[0]["input_ids"], layer_ids), rtol=1e-4, atol=1e-4
    )


def test_extractor_stops_after_last_needed_layer(smol):
    calls = {}
    handles = []
    hooks_before = [len(m._forward_hooks) for m in smol.model.layers]  # HF may have installed its own
    named = [(f"layer{i}", layer) for i, layer in enumerate(smol.model.layers)]
    named += [("norm", smol.model.norm), ("lm_head", smol.lm_head)]
    for name, module in named:
        calls[name] = 0
        handles.append(
            module.register_forward_pre_hook(lambda m, a, name=name: calls.__setitem__(name, calls[name] + 1))
        )
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        out = TargetFeatureExtractor(smol, [1, 7, 14])(ids, torch.ones_like(ids))
    finally:
        for h in handles:
            h.remove()
    assert out.shape == (1, 4, 3 * 576)
    assert [calls[f"layer{i}"] for i in range(15)] == [1] * 15
    assert [calls[f"layer{i}"] for i in range(15, 30)] == [0] * 15
    assert calls["norm"] == 0 and calls["lm_head"] == 0
    assert [len(m._forward_hooks) for m in smol.model.layers] == hooks_before  # no hooks left behind


def test_extractor_on_qwen3_5_wrapper_with_linear_attention():
    # The production target family (Qwen3.5/3.6): hybrid linear/full attention, decoder at
    # model.model.language_model in the multimodal wrapper. Tiny random config, no hub access.
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    layer_ids = [1, 3, 7]
    ids = torch.randint(3, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    out = TargetFeatureExtractor(model, layer_ids)(ids, mask, dtype=torch.float32)
    for b, n in ((0, 12), (1, 8)):
        torch.testing.assert_close(
            out[b, :n], reference_features(model, ids[b, :n].tolist(), layer_ids), rtol=1e-4, atol=1e-5
        )


def test_iter_batches_by_token_budget():
    lengths = [10, 50, 20, 20, 5, 200, 30]
    batches = list(iter_batches_by_token_budget(lengths, 100))
    # Longest first: 200 alone (over budget), 50+30 -> 2*50, 20+20+10+5 -> 4*20 = 80.
    assert batches == [[5], [1, 6], [2, 3, 0, 4]]
    assert sorted(p for b in batches for p in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[p] for p in b) <= 100
    assert list(iter_batches_by_token_budget([], 10)) == []
    with pytest.raises(ValueError):
        list(iter_batches_by_token_budget([1], 0))


def test_extract_partition_shards_equal_reference(smol, tmp_path):
    layer_ids = [1, 8, 14]
    rows = make_rows([9, 4, 13, 7, 12], smol.config.vocab_size, seed=2, first_index=100)
    shuffled = [rows[i] for i in (3, 0, 4, 1, 2)]  # the shard plan must follow index order, not input order
    events = []
    result = extract_partition(
        smol,
        shuffled,
        tmp_path,
        layer_ids,
        rows_per_shard=2,
        max_tokens_per_batch=26,
        progress_cb=events.append,
        model_name="SmolLM2-135M-Instruct",
    )
    names = ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert result.written_shards == names and result.skipped_shards == []
    assert [e["shard"] for e in events] == names and not any(e["skipped"] for e in events)
    index = read_index(tmp_path)
    assert index["complete"] is True and [s["rows"] for s in index["shards"]] == [2, 2, 1]
    assert index["num_tokens"] == 45 and index["target_layer_ids"] == layer_ids
    for name, size in zip(names, (s["bytes"] for s in index["shards"])):
        assert os.path.getsize(tmp_path / name) == size
    seen = []
    for name in names:
        shard = read_shard(tmp_path / name)
        assert shard.target_layer_ids == layer_ids and shard.hidden_size == 576
        assert shard.model_name == "SmolLM2-135M-Instruct"
        assert shard.hidden_states.dtype == torch.bfloat16 and shard.input_ids.dtype == torch.int32
        assert shard.loss_mask.dtype == torch.int8 and shard.cu_seqlens.dtype == torch.int64
        for r in range(shard.num_rows):
            row = shard.row(r)
            src = rows[row["index"] - 100]
            assert row["input_ids"].tolist() == src["input_ids"] and row["loss_mask"].tolist() == src["loss_mask"]
            assert_bf16_close(row["hidden_states"], reference_features(smol, src["input_ids"], layer_ids))
            seen.append(row["index"])
        # The official safetensors reader parses the hand-encoded file identically.
        official = load_file(tmp_path / name)
        assert torch.equal(official["hidden_states"], shard.hidden_states)
        assert torch.equal(official["cu_seqlens"], shard.cu_seqlens)
    assert seen == [100, 101, 102, 103, 104]


def test_bytes_on_disk_per_token(tiny, tmp_path):
    rows = make_rows(list(range(20, 120, 5)) * 2, 256, seed=3)
    result = extract_partition(tiny, rows, tmp_path, [1, 2, 3, 4, 5], rows_per_shard=20, max_tokens_per_batch=512)
    tokens = result.index["num_tokens"]
    on_disk = sum(os.path.getsize(tmp_path / s["name"]) for s in result.index["shards"])
    assert tokens == 2 * sum(range(20, 120, 5))
    assert on_disk == result.index["total_bytes"]
    ideal = 5 * 64 * 2  # n_layers * hidden_size * 2 bytes (bf16)
    assert abs(on_disk / tokens - ideal) / ideal < 0.02
    estimate = estimate_bytes(tokens, 5, 64, 2, num_rows=len(rows), num_shards=2)
    assert on_disk <= estimate <= on_disk * 1.02


def test_free_space_check(tiny, tmp_path, monkeypatch):
    with pytest.raises(InsufficientDiskSpaceError) as err:
        check_free_space(tmp_path / "not" / "yet", 2**62)
    message = str(err.value)
    assert str(tmp_path / "not" / "yet") in message and f"{2**62:,}" in message and "free" in message
    assert check_free_space(tmp_path, 1) > 0

    monkeypatch.setattr(tf.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 1000})())
    with pytest.raises(InsufficientDiskSpaceError) as err:
        extract_partition(tiny, make_rows([30, 30], 256), tmp_path / "part", TINY_LAYER_IDS, rows_per_shard=1)
    assert "1,000 bytes" in str(err.value)
    assert not list((tmp_path / "part").glob("shard-*"))  # refused before writing anything


def test_validate_shard_rejects_bad_files(tiny, tmp_path):
    rows = make_rows([8, 6], 256, seed=4)
    extract_partition(tiny, rows, tmp_path, TINY_LAYER_IDS, rows_per_shard=2, model_name="tiny")
    path = tmp_path / "shard-00000.safetensors"
    assert validate_shard(path, 2, [0, 1], expected_metadata={"model_name": "tiny", "target_layer_ids": "[1, 3, 5]"})
    assert not validate_shard(path, 3)
    assert not validate_shard(path, 2, [0, 2])
    assert not validate_shard(path, expected_metadata={"model_name": "other"})
    data = path.read_bytes()
    for name, content in [("trunc", data[:-1]), ("extra", data + b"\0"), ("garbage", b"not a shard"), ("empty", b"")]:
        (tmp_path / name).write_bytes(content)
        assert not validate_shard(tmp_path / name), name
    # A byte flipped inside input_ids breaks rows_sha256.
    shard = read_shard(path)
    bad = tmp_path / "bad.safetensors"
    write_shard(
        bad,
        shard.hidden_states,
        shard.input_ids,
        shard.loss_mask,
        shard.cu_seqlens,
        shard.row_index,
        target_layer_ids=TINY_LAYER_IDS,
        hidden_size=64,
        model_name="tiny",
    )
    raw = bytearray(bad.read_bytes())
    at = raw.index(shard.input_ids[:4].numpy().tobytes())
    raw[at] ^= 1
    bad.write_bytes(bytes(raw))
    assert not validate_shard(bad)
    with pytest.raises(ValueError):
        write_shard(
            bad,
            shard.hidden_states[:-1],
            shard.input_ids,
            shard.loss_mask,
            shard.cu_seqlens,
            shard.row_index,
            target_layer_ids=TINY_LAYER_IDS,
            hidden_size=64,
        )

    # Same indices, new tokens (e.g. regenerated completions): the stale shard is recomputed.
    before = path.read_bytes()
    changed = [dict(rows[0]), rows[1]]
    changed[0]["input_ids"] = [*changed[0]["input_ids"][:-1], 7]
    result = extract_partition(tiny, changed, tmp_path, TINY_LAYER_IDS, rows_per_shard=2, model_name="tiny")
    assert result.written_shards == ["shard-00000.safetensors"] and path.read_bytes() != before
    assert read_shard(path).input_ids[7].item() == 7


CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from dflash_assets.dflash.shards import extraction as shards
    from dflash_assets.dflash.shards import format as shard_format

    model_dir, rows_path, out_dir, stall_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = json.loads(open(rows_path).read())
    real_write, writes = shard_format._write_payload, [0]

    def write_then_stall(f, header, tensors):
        # On the chosen shard write only part of the file, then wait to be killed mid-write.
        if writes[0] == stall_at:
            f.write(header)
            f.write(bytes(shard_format._tensor_bytes(tensors["hidden_states"]))[:1000])
            f.flush()
            os.fsync(f.fileno())
            print("PARTIAL", flush=True)
            time.sleep(300)
        writes[0] += 1
        real_write(f, header, tensors)

    shard_format._write_payload = write_then_stall  # what write_shard calls
    shards.extract_partition(
        model, rows, out_dir, [1, 3, 5], rows_per_shard=3, max_tokens_per_batch=64,
        progress_cb=lambda e: print(json.dumps(e), flush=True), model_name="tiny",
    )
    print("DONE", flush=True)
    """
)


def test_kill_during_extraction_then_resume_is_byte_identical(tiny_dir, tmp_path):
    rows = make_rows([12, 30, 7, 25, 18, 9, 40, 16, 22, 11, 5, 33], 256, seed=5)
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def start(out, stall_at):
        args = [
            sys.executable,
            str(tmp_path / "child.py"),
            str(tiny_dir),
            str(tmp_path / "rows.json"),
            str(out),
            str(stall_at),
        ]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)

    reference = start(tmp_path / "ref", -1)  # uninterrupted, runs alongside the killed one
    victim = start(tmp_path / "run", 2)
    try:
        lines = []
        for line in victim.stdout:
            lines.append(line)
            if line.startswith("PARTIAL"):
                break
        assert lines and lines[-1].startswith("PARTIAL"), "".join(lines) + victim.stderr.read()
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
        ref_out, ref_err = reference.communicate(timeout=300)
        assert reference.returncode == 0 and "DONE" in ref_out, ref_err
    finally:
        for proc in (victim, reference):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    partial = list(run.glob(".shard-00002.safetensors.*.tmp"))
    assert len(partial) == 1 and read_index(run)["complete"] is False
    # Also leave a truncated file under the final name, as a non-atomic copy would: it must be redone.
    (run / "shard-00002.safetensors").write_bytes(partial[0].read_bytes())
    assert not validate_shard(run / "shard-00002.safetensors")
    kept = {
        n: ((run / n).stat().st_ino, (run / n).stat().st_mtime_ns)
        for n in ("shard-00000.safetensors", "shard-00001.safetensors")
    }

    resume = start(run, -1)
    out, err = resume.communicate(timeout=300)
    assert resume.returncode == 0 and "DONE" in out, err
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(e["shard"], e["skipped"]) for e in events] == [
        ("shard-00000.safetensors", True),
        ("shard-00001.safetensors", True),
        ("shard-00002.safetensors", False),
        ("shard-00003.safetensors", False),
    ]
    for name, stat in kept.items():
        assert ((run / name).stat().st_ino, (run / name).stat().st_mtime_ns) == stat
    assert not list(run.glob(".*.tmp"))
    ref = tmp_path / "ref"
    names = sorted(p.name for p in ref.iterdir())
    assert names == sorted(p.name for p in run.iterdir())
    assert len(names) == 5
    for name in names:
        assert (run / name).read_bytes() == (ref / name).read_bytes(), name
    assert read_index(run)["complete"] is True
