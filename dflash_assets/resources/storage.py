"""The storage resource: where every asset's files live (local directory or S3)."""

import os

import dagster as dg
from pydantic import Field

from dflash_assets.settings import cache_dir, default_storage_root
from dflash_assets.storage import Storage


class StorageResource(dg.ConfigurableResource):
    """Storage root for all stages: a local directory (default ``<DAGSTER_HOME>/dflash_data``) or
    ``s3://bucket/prefix``. S3 credentials come from the environment (``dagster.EnvVar``), never from
    literal config, and are never logged.

    ``scratch_dir`` is local disk for files that must be appended to while a run is in flight (row
    journals, server logs); for local storage it is the storage root itself.
    """

    root: str = Field(default_factory=default_storage_root, description="Local directory or s3://bucket/prefix.")
    scratch_dir: str = Field(default="", description="Local scratch for S3 storage; empty = <cache>/scratch.")

    def open(self) -> Storage:
        """A :class:`Storage` over ``root``."""
        return Storage(self.root)

    def local_scratch(self, *parts: str) -> str:
        """A local path for in-flight files; its parent directory exists."""
        base = self.root if "://" not in self.root or self.root.startswith("file://") else (self.scratch_dir or str(cache_dir() / "scratch"))
        path = os.path.join(base.removeprefix("file://"), *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def open_journal(self, *parts: str):
        """The row journal for in-flight rows at ``parts`` (e.g. ``("completions", "<pk>.journal.jsonl")``).

        Local storage: a :class:`RowJournal` beside the partition table. ``discard()`` removes it once
        the partition table is written.
        """
        from dflash_assets.generation.journal import RowJournal

        journal = RowJournal(self.local_scratch(*parts))
        return journal
