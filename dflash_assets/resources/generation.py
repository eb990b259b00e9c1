"""The generation-settings resource: the one place where the cap and sampling are set."""

import dagster as dg
from pydantic import Field

from dflash_assets.settings import GenerationSettings

_DEFAULTS = GenerationSettings()


class GenerationResource(dg.ConfigurableResource):
    """Generation settings for the ``completions`` stage (and everything that depends on them).

    Change them in the launchpad (resources.generation.config), in the project's run config, or from
    the shell with ``--config-json``. Every completions row records the settings it was made with.
    """

    # strict: YAML `true` or "20" would otherwise become a cap of 1 or 20 (a lowered cap cuts rows for good)
    max_output_tokens: int = Field(
        default=_DEFAULTS.max_output_tokens, ge=1, strict=True, description="Generation cap, tokens."
    )
    temperature: float = Field(default=_DEFAULTS.temperature, strict=True)
    top_p: float = Field(default=_DEFAULTS.top_p, strict=True)
    top_k: int = Field(default=_DEFAULTS.top_k, strict=True)
    min_p: float = Field(default=_DEFAULTS.min_p, strict=True)
    presence_penalty: float = Field(default=_DEFAULTS.presence_penalty, strict=True)
    repetition_penalty: float = Field(default=_DEFAULTS.repetition_penalty, strict=True)
    seed: int | None = Field(default=_DEFAULTS.seed, strict=True)
    enable_thinking: bool = Field(default=_DEFAULTS.enable_thinking, strict=True)

    def settings(self) -> GenerationSettings:
        """The immutable settings object the client and the row records use."""
        return GenerationSettings(**{k: getattr(self, k) for k in GenerationSettings.model_fields})
