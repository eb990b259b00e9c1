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
        return GenerationSettings(**{k: getattr(self, k) for k in GenerationFields.model_fields})


def served_settings(generation: GenerationResource, inference, target_model) -> GenerationSettings:
    """The settings rows are made and judged by: ``generation``'s, judged against ``inference``'s context
    (:meth:`~dflash_assets.stages.resources.inference.InferenceServerResource.context_length`) and stamped with
    ``target_model``'s chat template (the servers render with it: another template makes every row stale).

    Raises:
        dflash_assets.generation.engines.chat_render.ChatTemplateError: ``target_model.chat_template`` names no readable
            file.
    """
    settings = generation.settings().with_template(target_model.chat_template_text())
    return settings.with_context(inference.context_length())


def configured_settings() -> GenerationSettings:
    """The active config file's generation settings (``resources.generation``), judged with its servers' context
    (``resources.inference``, :meth:`~dflash_assets.stages.resources.inference.InferenceServerResource.context_length`;
    None when that section does not load) and stamped with its chat template (``resources.target_model``).

    Raises:
        dflash_assets.common.config.ConfigError: the config file or its generation section is invalid.
        dflash_assets.generation.engines.chat_render.ChatTemplateError: ``target_model.chat_template`` names no readable
            file.
    """
    from dflash_assets.common.config import resource_fields
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    template = TargetModelResource(**resource_fields("target_model")).chat_template_text()
    settings = GenerationResource(**resource_fields("generation")).settings().with_template(template)
    try:
        context = InferenceServerResource(**resource_fields("inference")).context_length()
    except Exception:  # a bad inference section is the run's to report; the rows are judged without a context
        context = None
    return settings.with_context(context)
