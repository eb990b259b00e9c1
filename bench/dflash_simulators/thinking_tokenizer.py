"""A target-like tokenizer with thinking markers, made from what the project ships (no hub download).

SmolLM2's tokenizer (the embedded local model) plus ``<think>`` / ``</think>`` added tokens and a
Qwen3-style chat template, written to a directory that ``AutoTokenizer.from_pretrained`` loads. Tests of
thinking layouts and the GPU-node simulator's ``model_path`` use it where the real target (Qwen3.6) is
not here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

THINK_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if "
    "enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- elif "
    "OPENS %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def write_thinking_tokenizer(directory: Path | str, opens_think: bool) -> Path:
    """Write the tokenizer to ``directory`` and return it.

    ``opens_think``: the generation prompt ends with ``<think>\\n`` (Qwen3.6 layout); else with
    ``<|im_start|>assistant\\n`` (Qwen3 layout). Thinking off always renders an empty think block.

    Raises:
        RuntimeError: the base tokenizer already had the thinking tokens (it would not be SmolLM2's).
    """
    from transformers import AutoTokenizer

    from dflash_assets.generation.engines.local_model import ensure_local_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    src = ensure_local_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, directory / name)
    tok = AutoTokenizer.from_pretrained(directory)
    if tok.add_tokens(["<think>", "</think>"]) != 2:
        raise RuntimeError(f"{src}: the tokenizer already has <think>/</think>; expected SmolLM2's")
    tok.chat_template = THINK_TEMPLATE.replace("OPENS", "true" if opens_think else "false")
    tok.save_pretrained(directory)
    return directory
