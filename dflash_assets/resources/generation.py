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

    max_output_tokens: int = Field(default=_DEFAULTS.max_output_tokens, ge=1, description="Generation cap, tokens.")
    temperature: float = _DEFAULTS.temperature
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k
    min_p: float = _DEFAULTS.min_p
    presence_penalty: float = _DEFAULTS.presence_penalty
    repetition_penalty: float = _DEFAULTS.repetition_penalty
    seed: int | None = _DEFAULTS.seed
    enable_thinking: bool = _DEFAULTS.enable_thinking

    def settings(self) -> GenerationSettings:
        """The immutable settings object the client and the row records use."""
        return GenerationSettings(**{k: getattr(self, k) for k in GenerationSettings.model_fields})
