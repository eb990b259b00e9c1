"""tokenize_stage's fast paths keep their answers: the Rust batch encoder gives tokenizer()'s ids, the
round-trip check still flags ids that do not decode to the recorded text (on chunked and sliced frames
too), the re-tokenized length check counts, and the data version is the hash of the file written."""

from __future__ import annotations

import hashlib
import json

import polars as pl
import pytest
from transformers import AutoTokenizer

from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.sequence_builder import SequenceBuilder
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration.check_gate import CHECK_ROUNDTRIP
from dflash_assets.stages.tokenized import CHECK_RETOKENIZED, TokenizeConfig, run_checks, tokenize_stage
from dflash_assets.storage.store import Storage

PK = "0000000-0000005"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ensure_local_model())


def row(index: int, content: str, output_token_ids=None, completion_tokens: int = 0) -> dict:
    settings = GenerationSettings(max_output_tokens=64)
    return {
        "index": index,
        "prompt_id": f"t:{index}",
        "prompt_hash": f"h{index}",  # the corpus's content_hash of the prompt it answers (issue 26)
        "source": "t",
        "reasoning_content": None,
        "content": content,
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "completion_tokens": completion_tokens,
        "output_token_ids": output_token_ids,
        "truncated_in_reasoning": False,
        "empty_answer": False,
        "max_output_tokens": 64,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": json.dumps(settings.model_dump(), sort_keys=True),
        "latency_s": 0.1,
        "server": "t",
        "attempts": 1,
        "error": None,
    }


def test_fast_encoder_gives_the_tokenizer_calls_ids(tok):
    texts = ["Hello <|im_end|> world", "  spaced\n\n\tout  ", "ünïcødé → 数学 🙂", "", "<|im_start|>user\nhi"]
    builder = SequenceBuilder(tok)
    assert builder._fast_backend() is not None
    assert builder.encode_texts(texts) == tok(texts, add_special_tokens=False)["input_ids"]
    # a tokenizer that splits special tokens: the transformers call (which sets the backend) is matched too
    split = AutoTokenizer.from_pretrained(ensure_local_model(), split_special_tokens=True)
    want = split(texts, add_special_tokens=False)["input_ids"]
    assert want != tok(texts, add_special_tokens=False)["input_ids"]
    splitting = SequenceBuilder(split)
    assert splitting.encode_texts(texts) == want and splitting.encode_texts(texts) == want


def test_roundtrip_and_length_checks_flag_the_right_rows(tmp_path, tok):
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [
        row(0, "Hello world.", completion_tokens=len(enc("Hello world.")) + 1),  # re-tokenized: round-trips
        row(1, "Hello world.", output_token_ids=enc("Goodbye world.")),  # server ids of other text: flagged
        row(2, "Hello   world.\n", output_token_ids=enc("Hello world.")),  # whitespace differs only: passes
        row(3, "A much longer answer " * 20, output_token_ids=enc("Wrong " * 80)),  # wrong but cut: not checked
        row(4, "Count me.", completion_tokens=len(enc("Count me.")) + 1),  # re-tokenized: length differs (+ end)
        row(5, "Also fine.", completion_tokens=len(enc("Also fine.")) + 3),
    ]
    completions = rows_to_frame(rows)
    prompts = pl.DataFrame(
        {
            "index": list(range(6)),
            "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(6)],
            "content_hash": [f"h{i}" for i in range(6)],
        }
    )
    config = TokenizeConfig(max_length=60, over_max_length="cut")
    store = Storage(str(tmp_path))
    tokenized, _aside, counts, _uri, version, checks = tokenize_stage(
        store, PK, completions, prompts, SequenceBuilder(tok), config, 64
    )
    assert counts["kept"] == 6 and counts["cut"] == 1 and tokenized.filter(pl.col("cut"))["index"].to_list() == [3]
    by_name = {c.check_name: c for c in checks}
    assert not by_name[CHECK_ROUNDTRIP].passed
    assert json.loads(by_name[CHECK_ROUNDTRIP].metadata["first_indexes"].value) == [1]
    # rows 0, 4, 5 were re-tokenized; 0 and 4 count the end token, so only row 5 differs
    retok = by_name[CHECK_RETOKENIZED]
    assert retok.metadata["retokenized_rows"].value == 3 and json.loads(retok.metadata["first_indexes"].value) == [5]
    written = tmp_path / "tokenized_sequences" / f"{PK}.parquet"
    assert version == hashlib.sha256(written.read_bytes()).hexdigest()[:20]
    assert pl.read_parquet(written).equals(tokenized)
    assert (tmp_path / "tokenized_sequences" / f"{PK}.set_aside.parquet").exists()

    # the same answers from a frame in several Arrow chunks, and from a slice (offsets not starting at 0)
    builder = SequenceBuilder(tok)
    chunked = pl.concat([tokenized.head(2), tokenized.tail(4)], rechunk=False)
    assert chunked["input_ids"].n_chunks() == 2
    for frame, expect in ((chunked, [1]), (tokenized.slice(2), []), (tokenized.slice(1, 2), [1])):
        result = {c.check_name: c for c in run_checks(frame, completions, builder, config, 64)}[CHECK_ROUNDTRIP]
        assert json.loads(result.metadata["first_indexes"].value) == expect and result.passed == (not expect)


def test_table_decode_equals_the_rust_decoder(tok):
    """decode_spans (token-bytes table) returns what the Rust decoder returns: on texts with multi-byte
    characters, special tokens and whitespace runs, on random id runs that split characters, and with a
    stop row's end token dropped."""
    import random

    import numpy as np

    from dflash_assets.data.token_bytes import byte_level_token_bytes

    builder = SequenceBuilder(tok)
    table = byte_level_token_bytes(tok)
    assert table is not None and len(table) == len(tok.backend_tokenizer.get_vocab(with_added_tokens=True))
    rng = random.Random(7)
    texts = [
        "héllo wörld 你好 😀 <|im_end|> tabs\t\tand\n\nnewlines  double  spaces",
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(400)),
    ]
    runs = [tok.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    runs += [[rng.randrange(len(table)) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    runs.append(runs[0] + [builder.end_token_id])
    flat = np.array([i for run in runs for i in run])
    ends = np.cumsum([len(run) for run in runs])
    spans = [
        (int(e) - len(run), int(e), "stop" if k == len(runs) - 1 else "length")
        for k, (run, e) in enumerate(zip(runs, ends))
    ]
    expected = tok.backend_tokenizer.decode_batch([*runs[:-1], runs[0]], skip_special_tokens=False)
    assert builder.decode_spans(flat, spans) == expected
    assert builder.decode_spans(flat, spans)[0] == texts[0]


def test_table_decode_is_refused_for_a_tokenizer_that_is_not_byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from dflash_assets.data.token_bytes import byte_level_token_bytes

    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.decoder = decoders.WordPiece()
    assert byte_level_token_bytes(PreTrainedTokenizerFast(tokenizer_object=word_level)) is None
