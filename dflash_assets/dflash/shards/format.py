"""Hidden-state shards on disk: the format, atomic byte-identical writes, reading and validation.

Format (one partition = one directory, ``shard-NNNNN.safetensors`` + ``index.json``). Each shard is a
safetensors file holding the rows ``[k * rows_per_shard, (k + 1) * rows_per_shard)`` of the partition
in prompt-index order, concatenated token-wise (packed, no padding):

=================  ======================================  ======
tensor             shape                                   dtype
=================  ======================================  ======
``cu_seqlens``     ``[rows + 1]``; row r is tokens         int64
                   ``cu_seqlens[r]:cu_seqlens[r + 1]``
``row_index``      ``[rows]``, prompt index of each row    int64
``input_ids``      ``[total_tokens]``                      int32
``hidden_states``  ``[total_tokens, n_layers * hidden]``   bf16
``loss_mask``      ``[total_tokens]``, 1 = train on token  int8
=================  ======================================  ======

``hidden_states[:, k*H:(k+1)*H]`` is the output of target decoder layer ``target_layer_ids[k]``
(HF ``hidden_states[target_layer_ids[k] + 1]``) at each token position. The safetensors metadata
(all strings) holds ``format``, ``target_layer_ids`` (JSON list), ``hidden_size``, ``model_name``,
``dtype``, ``num_rows``, ``num_tokens`` and ``rows_sha256`` (SHA-256 of the row_index, cu_seqlens,
input_ids and loss_mask bytes, so a shard computed from other tokens is detected as stale).

The files are written by this module's own safetensors encoder rather than ``safetensors.torch.save``
because the latter serializes ``__metadata__`` in a per-process random (hash-map) order, which would
make reruns differ byte-wise; here the header JSON has a fixed key order, so the same rows give
byte-identical files. Any safetensors reader (``safetensors.safe_open``) reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_assets.storage.atomic import atomic_write_bytes

FORMAT = "dflash-hidden-states/1"
INDEX_NAME = "index.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"

_DTYPE_CODES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Tensor order in the file: 8-byte types first keeps every tensor naturally aligned for mmap readers.
_TENSOR_ORDER = ("cu_seqlens", "row_index", "input_ids", "hidden_states", "loss_mask")
_FIXED_DTYPES = {"cu_seqlens": "I64", "row_index": "I64", "input_ids": "I32", "loss_mask": "I8"}
_MAX_HEADER_BYTES = 100 * 2**20


def shard_name(k: int) -> str:
    """File name of shard ``k``: ``shard-00000.safetensors``."""
    return SHARD_PATTERN.format(k)


def rows_sha256(
    row_index: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> str:
    """Hex SHA-256 over the little-endian bytes of row_index (int64), cu_seqlens (int64), input_ids
    (int32) and loss_mask (int8): the identity of a shard's token content."""
    digest = hashlib.sha256()
    for tensor, dtype in (
        (row_index, torch.int64),
        (cu_seqlens, torch.int64),
        (input_ids, torch.int32),
        (loss_mask, torch.int8),
    ):
        digest.update(_tensor_bytes(tensor.to(dtype)))
    return digest.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    # Raw little-endian bytes without a copy for contiguous CPU tensors (bf16 has no numpy dtype).
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def shard_metadata(
    target_layer_ids: Sequence[int],
    hidden_size: int,
    model_name: str,
    dtype: torch.dtype,
    num_rows: int,
    num_tokens: int,
    sha: str,
) -> dict[str, str]:
    return {
        "format": FORMAT,
        "target_layer_ids": json.dumps([int(i) for i in target_layer_ids]),
        "hidden_size": str(int(hidden_size)),
        "model_name": str(model_name),
        "dtype": DTYPE_NAMES[dtype],
        "num_rows": str(int(num_rows)),
        "num_tokens": str(int(num_tokens)),
        "rows_sha256": sha,
    }


def _encode_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in _TENSOR_ORDER:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


def _write_payload(f, header: bytes, tensors: dict[str, torch.Tensor]) -> None:
    f.write(header)
    for name in _TENSOR_ORDER:
        f.write(_tensor_bytes(tensors[name]))


class _HashingWriter:
    """File wrapper that feeds every written byte to a hash as well (one pass over the data)."""

    def __init__(self, f, digest) -> None:
        self._f, self._digest = f, digest

    def write(self, data) -> int:
        self._digest.update(data)
        return self._f.write(data)

    def __getattr__(self, name: str):  # flush, fileno, ... of the real file
        return getattr(self._f, name)


def file_sha256(path: str | os.PathLike, chunk: int = 8 * 2**20) -> str:
    """Hex SHA-256 of a file's bytes, read in 8 MiB chunks (never whole in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_shard(
    path: str | os.PathLike,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    row_index: torch.Tensor,
    *,
    target_layer_ids: Sequence[int],
    hidden_size: int,
    model_name: str = "",
    digest_out: dict | None = None,
) -> int:
    """Write one shard atomically (:func:`dflash_assets.storage.atomic.atomic_write_bytes`: temp file in the same
    directory, fsync, ``os.replace``, fsync of the directory).

    Args:
        path: destination ``.safetensors`` file (missing parent directories are created).
        hidden_states: ``[total_tokens, len(target_layer_ids) * hidden_size]``, bf16 (f16/f32 allowed).
        input_ids: ``[total_tokens]`` integer token ids (stored int32).
        loss_mask: ``[total_tokens]`` 0/1 (stored int8).
        cu_seqlens: ``[rows + 1]`` token offsets, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == total_tokens``.
        row_index: ``[rows]`` prompt index of each row.
        target_layer_ids, hidden_size, model_name: recorded in the metadata.
        digest_out: when given, ``digest_out["sha256"]`` is set to the file's SHA-256 (hashed while writing).

    Returns:
        Bytes written (the file size).

    Raises:
        ValueError: shapes or dtypes inconsistent with the format.
    """
    cu_seqlens = cu_seqlens.to(torch.int64).cpu()
    row_index = row_index.to(torch.int64).cpu()
    input_ids = input_ids.to(torch.int32).cpu()
    loss_mask = loss_mask.to(torch.int8).cpu()
    hidden_states = hidden_states.cpu()
    num_rows, num_tokens = row_index.numel(), input_ids.numel()
    feature_size = len(target_layer_ids) * int(hidden_size)
    problems = []
    if hidden_states.dtype not in DTYPE_NAMES:
        problems.append(f"hidden_states dtype {hidden_states.dtype} not one of {list(DTYPE_NAMES)}")
    if tuple(hidden_states.shape) != (num_tokens, feature_size):
        problems.append(f"hidden_states shape {tuple(hidden_states.shape)} != ({num_tokens}, {feature_size})")
    if input_ids.dim() != 1 or loss_mask.shape != input_ids.shape:
        problems.append(f"input_ids {tuple(input_ids.shape)} and loss_mask {tuple(loss_mask.shape)} must be equal 1-D")
    if row_index.dim() != 1 or tuple(cu_seqlens.shape) != (num_rows + 1,):
        problems.append(f"cu_seqlens shape {tuple(cu_seqlens.shape)} != ({num_rows + 1},)")
    elif int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens or bool((cu_seqlens.diff() < 0).any()):
        problems.append("cu_seqlens must start at 0, be non-decreasing and end at total_tokens")
    if problems:
        raise ValueError(f"invalid shard {path}: " + "; ".join(problems))
    sha = rows_sha256(row_index, cu_seqlens, input_ids, loss_mask)
    metadata = shard_metadata(target_layer_ids, hidden_size, model_name, hidden_states.dtype, num_rows, num_tokens, sha)
    tensors = {
        "cu_seqlens": cu_seqlens,
        "row_index": row_index,
        "input_ids": input_ids,
        "hidden_states": hidden_states,
        "loss_mask": loss_mask,
    }
    header = _encode_header(tensors, metadata)
    digest = hashlib.sha256() if digest_out is not None else None
    atomic_write_bytes(
        path, lambda f: _write_payload(f if digest is None else _HashingWriter(f, digest), header, tensors)
    )  # streamed
    if digest_out is not None:
        digest_out["sha256"] = digest.hexdigest()
    return os.path.getsize(path)


@dataclass
class ShardData:
    """A loaded shard (see the module docstring for shapes and dtypes)."""

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    row_index: torch.Tensor
    metadata: dict[str, str]
    target_layer_ids: list[int] = field(default_factory=list)
    hidden_size: int = 0
    model_name: str = ""

    @property
    def num_rows(self) -> int:
        return self.row_index.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def row(self, r: int) -> dict[str, Any]:
        """Row ``r`` (position in the shard): ``index`` (int) and views ``input_ids [T]``,
        ``loss_mask [T]``, ``hidden_states [T, n_layers * H]``."""
        start, end = int(self.cu_seqlens[r]), int(self.cu_seqlens[r + 1])
        return {
            "index": int(self.row_index[r]),
            "input_ids": self.input_ids[start:end],
            "loss_mask": self.loss_mask[start:end],
            "hidden_states": self.hidden_states[start:end],
        }


def read_shard(path: str | os.PathLike) -> ShardData:
    """Load a whole shard into CPU memory.

    Raises:
        safetensors.SafetensorError / OSError: unreadable or truncated file (use ``validate_shard`` first
        to get a bool instead).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {name: f.get_tensor(name) for name in _TENSOR_ORDER}
    return ShardData(
        **tensors,
        metadata=metadata,
        target_layer_ids=json.loads(metadata.get("target_layer_ids", "[]")),
        hidden_size=int(metadata.get("hidden_size", 0)),
        model_name=metadata.get("model_name", ""),
    )


def _read_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than 8 bytes")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError("header length beyond the file")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"file is {size} bytes, header describes {8 + n + end}")
    return header


def validate_shard(
    path: str | os.PathLike,
    expected_rows: int | None = None,
    expected_row_index: Sequence[int] | None = None,
    *,
    expected_metadata: dict[str, str] | None = None,
) -> bool:
    """True only if ``path`` is a complete, self-consistent shard matching the expectations; never raises.

    Checks: the safetensors header parses and its data offsets end exactly at the file size (a
    truncated file fails); all five tensors present with the format's dtypes and consistent shapes
    (``hidden_states`` is ``[num_tokens, len(target_layer_ids) * hidden_size]``); ``cu_seqlens`` starts
    at 0, is non-decreasing and ends at ``num_tokens``; ``loss_mask`` is 0/1; ``rows_sha256`` matches
    the stored token tensors; and, when given, the row count, the row indices and every
    ``expected_metadata`` key. The hidden-state values themselves are not read (writes are atomic).
    """
    try:
        from safetensors import safe_open

        path = Path(path)
        header = _read_header(path)
        meta = header.get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            return False
        layer_ids = json.loads(meta["target_layer_ids"])
        hidden_size = int(meta["hidden_size"])
        num_rows, num_tokens = int(meta["num_rows"]), int(meta["num_tokens"])
        hidden_code = {v: _DTYPE_CODES[k] for k, v in DTYPE_NAMES.items()}[meta["dtype"]]
        expected_shapes = {
            "cu_seqlens": [num_rows + 1],
            "row_index": [num_rows],
            "input_ids": [num_tokens],
            "loss_mask": [num_tokens],
            "hidden_states": [num_tokens, len(layer_ids) * hidden_size],
        }
        for name, shape in expected_shapes.items():
            info = header.get(name)
            if info is None or info["shape"] != shape or info["dtype"] != _FIXED_DTYPES.get(name, hidden_code):
                return False
        if expected_rows is not None and num_rows != expected_rows:
            return False
        if expected_metadata is not None and any(meta.get(k) != v for k, v in expected_metadata.items()):
            return False
        with safe_open(str(path), framework="pt") as f:
            small = {name: f.get_tensor(name) for name in ("cu_seqlens", "row_index", "input_ids", "loss_mask")}
        cu = small["cu_seqlens"]
        if int(cu[0]) != 0 or int(cu[-1]) != num_tokens or bool((cu.diff() < 0).any()):
            return False
        if bool(((small["loss_mask"] != 0) & (small["loss_mask"] != 1)).any()):
            return False
        if rows_sha256(small["row_index"], cu, small["input_ids"], small["loss_mask"]) != meta.get("rows_sha256"):
            return False
        return expected_row_index is None or small["row_index"].tolist() == [int(i) for i in expected_row_index]
    except Exception:
        return False


def write_index(out_dir: str | os.PathLike, index: dict[str, Any]) -> Path:
    """Write ``out_dir/index.json`` atomically (sorted keys, so equal content gives equal bytes)."""
    path = Path(out_dir) / INDEX_NAME
    data = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data)
    return path


def read_index(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The partition's ``index.json`` as a dict, or None when absent or unparsable."""
    try:
        return json.loads((Path(out_dir) / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return None
