"""Dagster resources: inference servers, generation settings, storage, target model."""

from dflash_assets.resources.inference import InferenceServerResource, ServerPool

__all__ = ["InferenceServerResource", "ServerPool"]
