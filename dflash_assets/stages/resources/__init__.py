"""Dagster resources: inference servers, generation settings, storage, target model (import each from its module)."""
