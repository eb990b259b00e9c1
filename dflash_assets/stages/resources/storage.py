"""The storage resource: where every asset's files live (local directory or S3)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

import dagster as dg
from pydantic import Field

from dflash_assets.common.config import SECRET_ENV
from dflash_assets.common.settings import cache_dir, default_storage_root
from dflash_assets.storage.store import RetryPolicy, Storage, StorageError, check_name

ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"


def s3_credentials_from_env() -> dict[str, Any]:
    """``aws_access_key_id`` / ``aws_secret_access_key`` / ``aws_session_token`` as ``dagster.EnvVar``
    references for the variables that are set (the values never enter config, run storage or logs)."""
    names = {
        "aws_access_key_id": ACCESS_KEY_ENV,
        "aws_secret_access_key": SECRET_KEY_ENV,
        "aws_session_token": SESSION_TOKEN_ENV,
    }
    return {field: dg.EnvVar(env) for field, env in names.items() if os.environ.get(env)}


def resolved_storage(fields: dict[str, Any]) -> StorageResource:
    """A :class:`StorageResource` of config ``fields`` with the S3 credentials of the environment, resolved, for
    code outside a run (``status``): an unresolved resource holds ``EnvVar`` references, and reading through it
    raises ``RuntimeError`` ("Attempted to directly retrieve environment variable")."""
    return StorageResource(**fields, **s3_credentials_from_env()).process_config_and_initialize()


class StorageResource(dg.ConfigurableResource):
    """Storage root for all stages: a local directory (default ``<DAGSTER_HOME>/dflash_data``) or
    ``s3://bucket/prefix`` (AWS or any S3-compatible endpoint).

    S3 credentials come from the environment only: pass ``dagster.EnvVar`` references
    (:func:`s3_credentials_from_env`), or leave them unset and boto's default chain (environment,
    profile, instance role) applies. They are handed to the S3 clients and nowhere else.
    ``endpoint_url`` / ``region`` / the credentials are the fields of dagster-aws's ``S3Resource``
    (:meth:`s3_resource`); the same values configure the fsspec/s3fs filesystem (:meth:`open`).

    ``scratch_dir`` is local disk for files that must be appended to or read by path while a run is in
    flight (row journals, hidden-state shards, training runs, server logs). For local storage it is the
    storage root itself; for S3 it is ``<scratch_dir or cache/scratch>/<bucket>/<prefix>``, and its
    contents are copies: a run on an empty scratch disk resumes from storage.

    Transient S3 errors are retried ``retry_attempts`` times with exponential backoff starting at
    ``retry_backoff_s`` seconds (capped at ``retry_max_wait_s``), then fail with a
    :class:`~dflash_assets.storage.store.StorageError` naming the object.
    """

    root: str = Field(default_factory=default_storage_root, description="Local directory or s3://bucket/prefix.")
    scratch_dir: str = Field(default="", description="Local scratch for S3 storage; empty = <cache>/scratch.")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, moto...); None = AWS.")
    region: str | None = Field(default=None, description="S3 region; None = from the environment / us-east-1.")
    # secrets: from the environment only (a value in the config file is refused, see
    # dflash_assets.common.config.secret_env)
    aws_access_key_id: str | None = Field(
        default=None,
        description="Set with EnvVar('AWS_ACCESS_KEY_ID'), never literally.",
        json_schema_extra={SECRET_ENV: ACCESS_KEY_ENV},
    )
    aws_secret_access_key: str | None = Field(
        default=None,
        description="Set with EnvVar('AWS_SECRET_ACCESS_KEY'), never literally.",
        json_schema_extra={SECRET_ENV: SECRET_KEY_ENV},
    )
    aws_session_token: str | None = Field(
        default=None,
        description="Set with EnvVar('AWS_SESSION_TOKEN'), never literally.",
        json_schema_extra={SECRET_ENV: SESSION_TOKEN_ENV},
    )
    journal_sync_rows: int = Field(
        default=100, ge=1, description="S3: sync the completions row journal every N rows..."
    )
    journal_sync_s: float = Field(
        default=30.0, gt=0, description="...or every this many seconds while rows are pending."
    )
    retry_attempts: int = Field(default=6, ge=1, description="S3: tries per call for transient errors.")
    retry_backoff_s: float = Field(
        default=0.5, ge=0, description="S3: first backoff wait, seconds (doubles each retry)."
    )
    retry_max_wait_s: float = Field(default=30.0, ge=0, description="S3: longest backoff wait, seconds.")
    connect_timeout_s: float = Field(default=10.0, gt=0, description="S3: connect timeout per request, seconds.")
    read_timeout_s: float = Field(default=120.0, gt=0, description="S3: read timeout per request, seconds.")

    @property
    def is_remote(self) -> bool:
        """True for object storage (``s3://...``), False for a local directory."""
        return "://" in self.root and not self.root.startswith("file://")

    def s3_resource(self):
        """The dagster-aws ``S3Resource`` with this endpoint, region and credentials (boto3 client via
        ``.get_client()``; botocore retries ``retry_attempts`` times)."""
        from dagster_aws.s3 import S3Resource

        return S3Resource(
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            max_attempts=self.retry_attempts,
            aws_access_key_id=self.aws_access_key_id,
            aws_secret_access_key=self.aws_secret_access_key,
            aws_session_token=self.aws_session_token,
        )

    def _storage_options(self) -> dict[str, Any]:
        if not self.is_remote:
            return {}
        return self._s3_options()

    def source_storage_options(self, spec: str) -> dict[str, Any]:
        """fsspec options for reading an input such as a prompt source: for ``s3://`` this resource's
        endpoint, region, credentials and timeouts (whatever the storage root is); ``{}`` otherwise."""
        return self._s3_options() if spec.startswith("s3://") else {}

    def _s3_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            # fresh listings every call: another process (or machine) may have written meanwhile
            "use_listings_cache": False,
            "skip_instance_cache": True,
            "config_kwargs": {
                "connect_timeout": self.connect_timeout_s,
                "read_timeout": self.read_timeout_s,
                # our RetryPolicy does the backoff; botocore makes one try per attempt
                "retries": {"max_attempts": 1, "mode": "standard"},
            },
        }
        if self.endpoint_url:
            options["endpoint_url"] = self.endpoint_url
        if self.region:
            options["client_kwargs"] = {"region_name": self.region}
        if self.aws_access_key_id:
            options["key"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            options["secret"] = self.aws_secret_access_key
        if self.aws_session_token:
            options["token"] = self.aws_session_token
        return options

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.retry_attempts, self.retry_backoff_s, self.retry_max_wait_s)

    def open(self) -> Storage:
        """A :class:`Storage` over ``root`` (s3fs with this resource's endpoint, credentials and retries)."""
        return Storage(self.root, self._storage_options(), self.retry_policy())

    def check(self) -> None:
        """Fail fast with a clear message when an S3 root's bucket cannot be reached (HEAD bucket through
        the ``S3Resource`` client, retried like every call). No-op for local roots.

        Raises:
            StorageError: endpoint unreachable or bucket missing / forbidden after the retries.
        """
        if not self.is_remote:
            return
        bucket = urlparse(self.root).netloc
        store = self.open()
        client = self.s3_resource().get_client()
        try:
            store.call("head-bucket", (), lambda: client.head_bucket(Bucket=bucket))
        except StorageError:
            raise
        except Exception as exc:  # botocore ClientError 403/404: permanent
            raise StorageError(
                f"storage root {self.root}: bucket {bucket!r} is not usable: {type(exc).__name__}: {exc}"
            ) from exc

    def local_scratch(self, *parts: str) -> str:
        """A local path for in-flight files; its parent directory exists.

        Raises:
            UnsafeNameError: a part is not one plain path component (``..``, a separator, an absolute
                path): names from storage (index files, listings) never reach outside the scratch tree.
        """
        for part in parts:
            check_name(part, "local path part")
        if not self.is_remote:
            base = self.root.removeprefix("file://")
        else:
            url = urlparse(self.root)
            base = os.path.join(
                self.scratch_dir or str(cache_dir() / "scratch"), url.netloc, *[p for p in url.path.split("/") if p]
            )
        path = os.path.join(base, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def ensure_local(self, *parts: str, size: int | None = None, refresh: bool = False) -> str:
        """Local path of ``parts``; for S3, downloaded to scratch when missing locally, when its size
        differs from ``size`` (bytes; the download must then have that size to be put in place), or always
        with ``refresh``. A missing object leaves the path absent (check ``os.path.exists``)."""
        path = self.local_scratch(*parts)
        if not self.is_remote:
            return path
        have = os.path.getsize(path) if os.path.exists(path) else None
        if refresh or have is None or (size is not None and have != size):
            try:
                self.open().download(path, *parts, size=size)
            except FileNotFoundError:
                if refresh and os.path.exists(path):
                    os.unlink(path)  # the local copy is stale: storage no longer has it
        return path

    def ensure_local_dir(self, *parts: str) -> str:
        """Local directory of folder ``parts``; for S3, every object directly under it is downloaded
        to scratch first (always: small folders such as the drafter export, which a rerun replaces).

        Raises:
            UnsafeNameError: a listed name is not one plain path component.
        """
        directory = os.path.dirname(self.local_scratch(*parts, "x"))
        if self.is_remote:
            for name in self.open().listdir(*parts):
                check_name(name, f"{self.open().uri(*parts)} listing")
                self.ensure_local(*parts, name, refresh=True)
        return directory

    def open_journal(self, *parts: str):
        """The row journal for in-flight rows at ``parts`` (e.g. ``("completions", "<pk>.journal.jsonl")``).

        Local storage: a :class:`~dflash_assets.generation.rows.journal.RowJournal` beside the partition
        table. S3: a :class:`~dflash_assets.generation.rows.journal_sync.SyncedRowJournal` in local scratch,
        rebuilt from storage when the local file is missing and synced every ``journal_sync_rows``
        rows / ``journal_sync_s`` seconds and on ``close()``. ``discard()`` removes it (both copies)
        once the partition table is written.
        """
        from dflash_assets.generation.rows.journal import RowJournal

        if not self.is_remote:
            return RowJournal(self.local_scratch(*parts))
        from dflash_assets.generation.rows.journal_sync import SyncedRowJournal

        return SyncedRowJournal(
            self.local_scratch(*parts),
            self.open(),
            tuple(parts),
            sync_rows=self.journal_sync_rows,
            sync_s=self.journal_sync_s,
        )
