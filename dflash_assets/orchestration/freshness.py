"""The one rule for whether an (asset, partition) is up to date, and why not.

The main job (:mod:`dflash_assets.app.main_job`), ``status``, the schedule and the sensor
(:mod:`dflash_assets.app.automation`) and the completions asset (whether a range run keeps a partition as it
is) all ask here. A reason is a short phrase (``None``: up to date):

================================  =====================================================================
asset                             not up to date when
================================  =====================================================================
``prompt_corpus``                 never built; the config or a prompt file (size, mtime / ETag) changed;
                                  built before stable indices (no ``partition_versions``)
``completions[pk]``               never built; the corpus's version of the partition's prompts (the hash
                                  of its ``(index, content_hash)`` pairs) is not the one the table was
                                  made for; rows the generation settings invalidate (error rows, other
                                  sampling, a cap their length rows or longest row does not fit, prompts
                                  set aside as too long under another cap or servers' context); made in
                                  another ``ops.completions.config.mode`` than the configured one
``tokenized_sequences[pk]``,      never built, or older than the latest materialization of the stage
``hidden_states[pk]``             before it (which happens only when that stage's table changed); its
                                  latest materialization failed a blocking check or has no evaluation of
                                  one (it raised), or the stage before it did
                                  (:mod:`dflash_assets.orchestration.check_gate`): until it is made again
                                  and passes
``truncation_report``             older than a completions partition
``dflash_drafter``,               older than its upstream, or its op config changed since its last
``drafter_evaluation``            materialization (the drafter then decides by data content whether to
                                  train, resume or reuse)
any of them                       its output is not in the configured storage (``output missing: <uri>``,
                                  :mod:`dflash_assets.storage.stage_outputs`): another root, or files deleted
================================  =====================================================================

Why not Dagster's own staleness (``CachingStaleStatusResolver``: code versions plus the data versions the
assets write): a completions partition depends on the generation *settings* (a resource, not a code
version) row by row, and on which prompts its range holds, which no data version of ``prompt_corpus``
(one unpartitioned table) can say per partition; and resolving it costs a walk of the asset graph per
partition (903 at the user's scale). The data versions the assets write still matter: a range run keeps
a partition whose table's hash is its latest data version (no new materialization, so the stages after
it stay up to date), and a table's change shows as a newer materialization.
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from dflash_assets.common.config import project_config
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.generation.rows.records import PROMPT_TOO_LONG, TOO_LONG_CAP, TOO_LONG_CONTEXT
from dflash_assets.orchestration.check_gate import check_reason, failed_blocking_checks
from dflash_assets.orchestration.history import latest_record, latest_records, plain_metadata
from dflash_assets.storage.stage_outputs import missing_outputs, missing_reason, output_missing
from dflash_assets.storage.store import Storage

NOT_MATERIALIZED = "not materialized"
PROMPTS_CHANGED = "prompts changed"
PROMPTS_UNVERSIONED = "made before rows named their prompt"


# ------------------------------------------------------------------------------------------ pure rules


def on_policy_limits() -> tuple[int, int]:
    """``(max_turns_per_conversation, max_rounds_per_user_turn)`` of ``ops.completions.config`` (their defaults
    when unset): what freshness compares an on-policy partition's limits with."""
    from dflash_assets.data.on_policy import DEFAULT_MAX_ROUNDS, DEFAULT_MAX_TURNS

    section = (project_config()["ops"].get("completions") or {}).get("config") or {}
    return (
        int(section.get("max_turns_per_conversation", DEFAULT_MAX_TURNS)),
        int(section.get("max_rounds_per_user_turn", DEFAULT_MAX_ROUNDS)),
    )


def corpus_reason(meta: dict | None, fingerprint: str) -> str | None:
    """Why ``prompt_corpus`` (its latest metadata) must be built again for the config ``fingerprint``."""
    if meta is None:
        return NOT_MATERIALIZED
    if meta.get("config_fingerprint") != fingerprint:
        return "the corpus config or a prompt file changed"
    if "partition_versions" not in meta:
        return "built before stable prompt indices"
    return None


def settings_reason(meta: dict, settings: GenerationSettings) -> str | None:
    """Why the generation ``settings`` invalidate rows of a completions partition (its latest metadata).

    Mirrors :func:`dflash_assets.generation.rows.records.invalid_reason` at partition level: raising the cap
    touches partitions with ``length`` rows cut at another cap, lowering it partitions holding a row
    longer than the new cap; error rows and changed sampling touch their partition too, and so does a cap or a
    servers' context (``settings.context_length``; None: not compared) other than the one its prompts set aside
    as too long were judged under."""
    cap = settings.max_output_tokens
    if meta.get("errors", 0):
        return "error rows"
    if meta.get("completion_tokens_missing", 0):
        return "no completion_tokens"
    if set(meta.get("finish_reasons", {})) - {"stop", "length", PROMPT_TOO_LONG}:  # abort etc.: redone
        return "unfinished rows"
    if any(fp != settings.sampling_fingerprint() for fp in meta.get("settings_fingerprints", [])):
        return "sampling or chat template changed"
    for cap_then, context_then in meta.get("prompt_too_long_judged", []):
        # prompts set aside as too long are judged again under another cap or context: they may fit now
        if cap_then != cap:
            return TOO_LONG_CAP
        if settings.context_length is not None and context_then != settings.context_length:
            return TOO_LONG_CONTEXT
    if meta.get("completion_tokens_max", 0) > cap:
        return "cap lowered"
    if any(c != cap for c in meta.get("length_row_caps", [])):
        return "cap raised"
    return None


def prompts_reason(meta: dict, corpus_version: str | None) -> str | None:
    """Why a completions partition's table does not answer the corpus's prompts of its range: its recorded
    ``prompts_version`` is not ``corpus_version`` (None: a corpus built before versions; not checked)."""
    if corpus_version is None:
        return None
    made_for = meta.get("prompts_version")
    if made_for == corpus_version:
        return None
    return PROMPTS_CHANGED if made_for else PROMPTS_UNVERSIONED


def mode_reason(meta: dict, mode: str | None) -> str | None:
    """Why a completions partition was made in another mode than ``mode`` (``ops.completions.config.mode``; None:
    not compared): its metadata's ``mode``, ``regenerate`` when it records none (made before modes)."""
    made_in = meta.get("mode") or "regenerate"
    return None if mode is None or made_in == mode else f"made in mode {made_in}, configured {mode}"


def on_policy_reason(meta: dict, settings: GenerationSettings | None, limits: tuple[int, int] | None) -> str | None:
    """Why an on-policy partition (its latest metadata) must run again: exactly when a change touches one of its
    conversations, as a settings change touches regenerate mode's rows. ``limits``: the configured
    ``(max_turns_per_conversation, max_rounds_per_user_turn)`` (None: not compared).

    - ``max_turns_per_conversation`` raised: a conversation the old limit ended (the run continues it); lowered:
      a conversation longer than the new one (cut to it);
    - ``max_rounds_per_user_turn`` raised: a user turn left at the old limit with a call pending; lowered: a user
      turn that had more replies;
    - the servers' context (``settings.context_length``) other than the one a conversation the servers refused
      to go on with was run under.

    A partition made before these counts were recorded counts as touched by any change of a limit."""
    if meta.get("mode") != "on_policy":
        return None
    if limits is not None:
        for (now, key), (cut, longest, what) in zip(
            zip(limits, ("max_turns_per_conversation", "max_rounds_per_user_turn")),
            (
                ("conversations_ended_at_max_turns", "conversation_turns_max", "conversations"),
                ("user_turns_ended_at_max_rounds", "rounds_max", "user turns"),
            ),
        ):
            then = meta.get(key)
            if then is None or now == then:
                continue
            if now > then and meta.get(cut, 1) > 0:
                return f"{key} raised ({then} -> {now}): {meta.get(cut, 'some')} {what} ended at the old limit"
            if now < then and meta.get(longest, then) > now:
                return f"{key} lowered ({then} -> {now}): {what} past the new limit"
    context = settings.context_length if settings is not None else None
    ended = meta.get("conversations_ended_at_context", 0)
    if context is not None and ended and meta.get("context_length") != context:
        then = meta.get("context_length")
        return f"servers' context changed ({then} -> {context}): {ended} conversations ended at it"
    return None


def completions_reason(
    meta: dict | None,
    settings: GenerationSettings | None,
    corpus_version: str | None,
    mode: str | None = None,
    limits: tuple[int, int] | None = None,
) -> str | None:
    """Why ``completions[pk]`` (its latest metadata, None when never materialized) is not up to date (``mode``:
    the configured ``ops.completions.config.mode``, None: not compared; ``limits``: the configured on-policy
    limits, :func:`on_policy_reason`)."""
    if meta is None:
        return NOT_MATERIALIZED
    return (
        mode_reason(meta, mode)
        or prompts_reason(meta, corpus_version)
        or (settings_reason(meta, settings) if settings is not None else None)
        or on_policy_reason(meta, settings, limits)
    )


def _storage_id(record: dg.EventLogRecord | int) -> int:
    return record if isinstance(record, int) else record.storage_id


def after_upstream_reason(
    record: dg.EventLogRecord | int | None,
    upstream: Sequence[dg.EventLogRecord | int | None],
    upstream_name: str = "upstream",
) -> str | None:
    """Why a stage built from ``upstream`` is not up to date: never materialized, or an upstream materialization
    is newer. Records or their storage ids."""
    if record is None:
        return NOT_MATERIALIZED
    if any(u is not None and _storage_id(u) > _storage_id(record) for u in upstream):
        return f"{upstream_name} changed since"
    return None


# ------------------------------------------------------------------------------------ instance queries


def corpus_versions(instance: dg.DagsterInstance) -> dict[str, str] | None:
    """``{partition key: version}`` of the latest corpus build (None: none, or one built before versions)."""
    meta = plain_metadata(latest_record(instance, "prompt_corpus"))
    return (meta or {}).get("partition_versions")


def completions_reasons(
    instance: dg.DagsterInstance,
    keys: Sequence[str],
    settings: GenerationSettings | None,
    records: dict[str, dg.EventLogRecord] | None = None,
    versions: dict[str, str] | bool | None = False,
    mode: str | None = None,
) -> dict[str, str | None]:
    """``{pk: reason or None}`` for every key (three instance queries whatever the count).

    ``records``/``versions``: already-fetched latest completions records and corpus versions (``False``:
    fetch them); ``mode``: the configured ``ops.completions.config.mode`` (None: not compared)."""
    if records is None:
        records = latest_records(instance, "completions", keys)
    if versions is False:
        versions = corpus_versions(instance)
    limits = on_policy_limits() if mode == "on_policy" else None
    return {
        pk: completions_reason(
            plain_metadata(records.get(pk)), settings, (versions or {}).get(pk) if versions else None, mode, limits
        )
        for pk in keys
    }


def partition_reason(
    instance: dg.DagsterInstance,
    stage: str,
    pk: str,
    settings: GenerationSettings | None = None,
    upstream: str | None = None,
    store: Storage | None = None,
) -> str | None:
    """Why ``stage[pk]`` is not up to date (``upstream``: the stage it is built from, for the later stages;
    ``store``: the configured storage, to check the output is there; None: not checked).
    :func:`partition_reasons` for one key."""
    return partition_reasons(instance, stage, [pk], settings, upstream, store)[pk]


def partition_reasons(
    instance: dg.DagsterInstance,
    stage: str,
    keys: Sequence[str],
    settings: GenerationSettings | None = None,
    upstream: str | None = None,
    store: Storage | None = None,
    mode: str | None = None,
) -> dict[str, str | None]:
    """``{pk: why stage[pk] is not up to date, or None}`` for every key, in this order of reasons: never
    materialized; (completions) prompts or settings; (later stages) ``upstream`` materialized since, a blocking
    check of the stage's latest materialization failed or was not evaluated (``failed check <asset>.<check>``,
    ``... (not evaluated: run 1a2b3c4d raised OSError: ...)``), or one of
    ``upstream``'s did (``<upstream> failed check ...``); the output missing from ``store``. ``mode``: the
    configured ``ops.completions.config.mode`` completions partitions are judged against (None: not compared).

    Instance reads: the latest records of ``stage`` and ``upstream`` (two queries each), one paged check
    history per blocking check; one listing of ``store`` per stage."""
    records = latest_records(instance, stage, keys)
    if stage == "completions":
        reasons = completions_reasons(instance, keys, settings, records, mode=mode)
    else:
        up = latest_records(instance, upstream, keys) if upstream else {}
        reasons = {pk: after_upstream_reason(records.get(pk), [up.get(pk)], upstream or "upstream") for pk in keys}
        own = failed_blocking_checks(instance, stage, {pk: r for pk, r in records.items() if not reasons.get(pk)})
        above = failed_blocking_checks(instance, upstream, up) if upstream else {}
        for pk in keys:
            if reasons[pk] is None and (why := check_reason(stage, own.get(pk))):
                reasons[pk] = why
            elif reasons[pk] is None and (why := check_reason(upstream or "", above.get(pk))):
                reasons[pk] = f"{upstream} {why}"
    if store is not None:
        fine = [pk for pk in keys if reasons[pk] is None]
        for pk, uri in missing_outputs(store, stage, fine, mode=mode).items():
            reasons[pk] = missing_reason(uri)
    return reasons


def output_reason(store: Storage | None, stage: str) -> str | None:
    """``"output missing: <uri>"`` when an unpartitioned ``stage``'s output is not in ``store`` (None: it is,
    or no store to check)."""
    return missing_reason(output_missing(store, stage)) if store is not None else None
