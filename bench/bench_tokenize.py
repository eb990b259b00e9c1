"""Tokenization throughput of the tokenized_sequences stage vs a bare batched tokenizer call.

Builds a realistic partition (default 1000 synthetic completions of a few hundred tokens each, one- or
three-turn prompts), then times, in the same process and alternating:

* ``asset``: :func:`dflash_assets.tokenization.tokenize_partition` (chat template, prompt and completion
  ids, loss masks, end tokens, polars output table), tokens/s over every output ``input_ids`` token;
* ``bare``: one batched ``tokenizer(texts, add_special_tokens=False)`` call over the same texts
  (rendered prompt + completion, templates pre-rendered so it does only BPE), tokens/s over its ids.

Prints both and ``ratio = asset / bare`` (target >= 0.8) from the best of ``--repeats`` runs each (on a
shared machine the minimum is the least disturbed time), plus the median ratio of back-to-back pairs.

    python bench/bench_tokenize.py [--rows 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import polars as pl

from dflash_assets.generation.local_model import ensure_local_model
from dflash_assets.generation.records import rows_to_frame
from dflash_assets.settings import GenerationSettings
from dflash_assets.tokenization import SequenceBuilder, TokenizePolicy, tokenize_partition

WORDS = ("the function returns a list of values for each item in the input array sorted by key "
         "def for while if else return import class self None True False int str dict len range "
         "print( ) [ ] { } : = == + - * / 0 1 2 10 42 100 x y i j n result value index count total").split()


def synthetic_text(rng: random.Random, n_words: int) -> str:
    """Prose-and-code-like text of ``n_words`` words with line breaks and indentation."""
    out = []
    for k in range(n_words):
        out.append(rng.choice(WORDS))
        if k % 12 == 11:
            out.append("\n" + "    " * rng.randint(0, 2))
    return " ".join(out)


def synthetic_partition(rows: int, seed: int = 0) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``(completions, prompts)``: ``rows`` stop completions of ~150-450 words, prompts of 1 or 3 turns."""
    rng = random.Random(seed)
    settings = GenerationSettings()
    prompts, completions = [], []
    for i in range(rows):
        messages = [{"role": "user", "content": synthetic_text(rng, rng.randint(20, 120))}]
        if rng.random() < 0.3:
            messages = [{"role": "system", "content": "You are a careful coding assistant."},
                        {"role": "user", "content": synthetic_text(rng, 30)},
                        {"role": "assistant", "content": synthetic_text(rng, 40)}, *messages]
        prompts.append({"index": i, "prompt_id": f"bench:{i}", "source": "bench", "messages": messages})
        completions.append({
            "index": i, "prompt_id": f"bench:{i}", "source": "bench", "reasoning_content": None,
            "content": synthetic_text(rng, rng.randint(150, 450)), "finish_reason": "stop", "prompt_tokens": 0,
            "completion_tokens": 0, "output_token_ids": None, "truncated_in_reasoning": False, "empty_answer": False,
            "max_output_tokens": settings.max_output_tokens, "settings_fingerprint": settings.sampling_fingerprint(),
            "settings": json.dumps(settings.model_dump(), sort_keys=True), "latency_s": 0.0, "server": "bench",
            "attempts": 1, "error": None,
        })
    return rows_to_frame(completions), pl.DataFrame(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_local_model())
    builder = SequenceBuilder(tokenizer)
    policy = TokenizePolicy(max_length=1 << 20)
    completions, prompts = synthetic_partition(args.rows)
    by_index = dict(zip(prompts["index"].to_list(), prompts["messages"].to_list()))
    texts = []
    for row in completions.iter_rows(named=True):
        prompt = builder.prompt_text(by_index[row["index"]], True)
        texts.append(prompt + builder.completion_text(row, prompt))

    asset_s, bare_s = [], []
    asset_tokens = bare_tokens = 0
    for _ in range(args.repeats):
        started = time.perf_counter()
        tokenized, _, counts = tokenize_partition(completions, prompts, builder, policy)
        asset_s.append(time.perf_counter() - started)
        asset_tokens = int(tokenized["input_ids"].list.len().sum())
        started = time.perf_counter()
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        bare_s.append(time.perf_counter() - started)
        bare_tokens = sum(len(x) for x in ids)
    assert counts["kept"] == args.rows, counts

    asset_rate, bare_rate = asset_tokens / min(asset_s), bare_tokens / min(bare_s)
    print(f"partition: {args.rows} rows, {asset_tokens} tokens (mean {asset_tokens / args.rows:.0f}/row, "
          f"completion {int(tokenized['num_loss_tokens'].sum()) / args.rows:.0f}/row); best of {args.repeats}")
    print(f"{'':8}{'seconds':>10}{'tokens':>10}{'tok/s':>12}")
    print(f"{'asset':8}{min(asset_s):>10.3f}{asset_tokens:>10}{asset_rate:>12.0f}")
    print(f"{'bare':8}{min(bare_s):>10.3f}{bare_tokens:>10}{bare_rate:>12.0f}")
    ratio = asset_rate / bare_rate
    paired = sorted((asset_tokens / a) / (bare_tokens / b) for a, b in zip(asset_s, bare_s))
    print(f"ratio asset/bare = {ratio:.2f} (target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}); "
          f"median of the {len(paired)} back-to-back pairs {paired[len(paired) // 2]:.2f}")


if __name__ == "__main__":
    main()
