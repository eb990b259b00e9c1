"""An export's and a target's files read without loading weights: a ``.safetensors`` header and a
``tokenizer.json`` vocabulary. Stdlib only (the GPU-node simulator imports them without torch)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any


def safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (8-byte little-endian length, then JSON), without the weights.

    Raises:
        ValueError: not a safetensors file (too short, or a header that is not a JSON object).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"header length {n} is implausible")
        data = f.read(n)
    header = json.loads(data)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def tokenizer_vocabulary(model_dir: str | os.PathLike) -> dict[str, int] | None:
    """Token -> id of ``model_dir/tokenizer.json`` (model vocabulary plus added tokens), or None without one."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    vocab = (
        dict((data.get("model") or {}).get("vocab") or {})
        if isinstance((data.get("model") or {}).get("vocab"), dict)
        else {}
    )
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and "content" in token and "id" in token:
            vocab[token["content"]] = token["id"]
    return vocab
