"""The storage resource: where every asset's files live (local directory or S3)."""


import dagster as dg
from pydantic import Field

from dflash_assets.settings import default_storage_root
from dflash_assets.storage import Storage


class StorageResource(dg.ConfigurableResource):
    """Storage root for all stages: a local directory (default ``<DAGSTER_HOME>/dflash_data``) or
    ``s3://bucket/prefix``. S3 credentials come from the environment (``dagster.EnvVar``), never from
    literal config, and are never logged."""

    root: str = Field(default_factory=default_storage_root, description="Local directory or s3://bucket/prefix.")

    def open(self) -> Storage:
        """A :class:`Storage` over ``root``."""
        return Storage(self.root)
