"""The bytes each token of a byte-level BPE vocabulary decodes to, for decoding many rows at once without the
tokenizer (no Dagster imports): :func:`byte_level_token_bytes`."""

from __future__ import annotations

import numpy as np

__all__ = ["byte_level_token_bytes"]


# GPT-2's byte-to-character map (printable bytes stand for themselves, the other 68 are written as
# U+0100 onwards), which byte-level BPE vocabularies are written in (Radford et al. 2019, the released
# encoder.py). As a str.translate table from a token's characters to latin-1 characters of its bytes.
def _byte_level_translation() -> dict[int, int]:
    kept = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    shifted = [b for b in range(256) if b not in kept]
    return {256 + n: b for n, b in enumerate(shifted)}


def byte_level_token_bytes(tokenizer, sample: int = 2000) -> np.ndarray | None:
    """``table[id]`` = the bytes token ``id`` decodes to, for a Rust tokenizer whose decoder is ByteLevel
    (added tokens: their content's UTF-8); None for any other tokenizer.

    Checked against the tokenizer itself on every added token and ``sample`` regular ones spread over the
    vocabulary: each one's bytes, where they form whole characters, must equal its Rust
    ``decode([id], skip_special_tokens=False)``, else None (the caller then uses the Rust decoder).

    Returns:
        an object array of ``bytes`` of length ``max id + 1`` (missing ids: ``b""``), or None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" or not hasattr(
        backend, "get_added_tokens_decoder"
    ):
        return None  # tokenizers.decoders.ByteLevel alone (a Sequence of decoders may change the text)
    translation = _byte_level_translation()
    added = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
    vocab = backend.get_vocab(with_added_tokens=True)
    table = np.full(max(vocab.values()) + 1, b"", dtype=object)
    for token, i in vocab.items():
        if token in added:
            table[i] = token.encode()
            continue
        try:
            table[i] = token.translate(translation).encode("latin-1")
        except UnicodeEncodeError:
            return None  # a character outside the byte alphabet: not a byte-level vocabulary
    regular = sorted(i for t, i in vocab.items() if t not in added)
    probe = sorted(set(added.values()) | set(regular[:: max(1, len(regular) // sample)]))
    for i, text in zip(probe, backend.decode_batch([[i] for i in probe], skip_special_tokens=False)):
        try:
            mine = table[i].decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial character on its own: both sides show replacement characters
        if mine != text:
            return None
    return table
