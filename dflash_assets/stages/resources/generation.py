"""The generation-settings resource: the one place where the cap and sampling are set."""

import dagster as dg

from dflash_assets.common.settings import GenerationFields, GenerationSettings


class GenerationResource(dg.ConfigurableResource, GenerationFields):
    """Generation settings for the ``completions`` stage (and everything that depends on them).

    Its fields are :class:`~dflash_assets.common.settings.GenerationFields` (declared once, with the settings rows
    record). Change them in the launchpad (resources.generation.config), in the project's run config, or from
    the shell with ``--config-json``. Every completions row records the settings it was made with.
    """

    def settings(self) -> GenerationSettings:
        """The immutable settings object the client and the row records use."""
        return GenerationSettings(**{k: getattr(self, k) for k in GenerationSettings.model_fields})
