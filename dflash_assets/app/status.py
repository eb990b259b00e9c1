"""``python -m dflash_assets status``: per-stage partition counts, completions progress, rate and ETA.

Partition statuses come from ``DagsterInstance.get_status_by_partition`` (the same source as the UI's
partition bars), completions numbers from the metadata of each partition's latest materialization.
With the current config's generation settings, a materialized partition that is not up to date by
:mod:`dflash_assets.orchestration.freshness` (the settings touch it, or the corpus's prompts of its range changed) has
the few columns the decision needs read from its table, and every row
:func:`dflash_assets.generation.rows.records.invalid_reason` or
:func:`~dflash_assets.generation.rows.records.prompt_mismatch` would request again counts as remaining: after
a cap change or a corpus edit, status shows what the run will do before anything runs. When the prompt
files changed since the corpus was built, it previews the next build (new, changed, removed prompts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg

from dflash_assets.app.stage_order import PARTITION_STAGES
from dflash_assets.app.status_lines import format_status
from dflash_assets.data.ranges import key_range
from dflash_assets.orchestration.check_gate import held_partitions
from dflash_assets.orchestration.history import latest_metadata, latest_records, plain_metadata
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.orchestration.pools import pool_usage

STAGES = tuple(PARTITION_STAGES)  # from the asset graph (dflash_assets.app.stage_order)
COMPLETIONS = "completions"


def partition_rows(partition_key: str) -> int:
    """Prompts in an index-range partition (both ends inclusive)."""
    first, last = key_range(partition_key)
    return last - first + 1


def stage_counts(instance: dg.DagsterInstance, asset_name: str, keys: Sequence[str]) -> dict:
    """Partition keys of one partitioned asset grouped by status.

    Returns ``{"done", "failed", "in_progress", "missing"}`` counts plus the keys of each group under
    ``"<group>_keys"`` (in partition-key order). ``done`` means the UI's "materialized": the latest
    attempt succeeded. A partition whose latest attempt failed counts as failed even if an older one
    succeeded; one with a run in flight counts as in progress whatever came before (Dagster's order).
    """
    by_status = instance.get_status_by_partition(dg.AssetKey(asset_name), list(keys), prompt_ranges) or {}
    groups: dict[str, list[str]] = {"done": [], "failed": [], "in_progress": [], "missing": []}
    name_of = {
        dg.AssetPartitionStatus.MATERIALIZED: "done",
        dg.AssetPartitionStatus.FAILED: "failed",
        dg.AssetPartitionStatus.IN_PROGRESS: "in_progress",
    }
    for pk in keys:
        groups[name_of.get(by_status.get(pk), "missing")].append(pk)
    out: dict = {name: len(pks) for name, pks in groups.items()}
    out.update({f"{name}_keys": pks for name, pks in groups.items()})
    return out


def invalid_rows(store, pk: str, settings, continues: bool = False, prompts=None) -> tuple[Counter, int, Counter, int]:
    """``(reasons, tokens, continued, cut)``: rows of completions partition ``pk`` that ``settings``
    regenerate, counted by :func:`~dflash_assets.generation.rows.records.invalid_reason`; the current
    completion tokens of those regenerated whole; when ``continues`` (the servers continue cut rows, see
    :mod:`~dflash_assets.generation.rows.continuation`), the rows to be continued counted by their cap; and
    the rows longer than a lowered cap, which the run cuts to it locally
    (:mod:`~dflash_assets.data.cap_cut`: no request, no token generated).

    ``prompts``: the corpus's rows of the partition (``index``, ``content_hash``, ``prompt_id``), when its
    prompts changed since the table was made: a row for another prompt counts as ``prompt changed`` (or
    ``prompt unknown``), a prompt without a row as ``missing``, a row whose prompt is gone as ``removed``
    (no request: the run drops it)."""
    from dflash_assets.data.truncation import read_report_columns
    from dflash_assets.generation.rows.continuation import continuable
    from dflash_assets.generation.rows.records import VALIDITY_COLUMNS, invalid_reason, prompt_mismatch
    from dflash_assets.stages.completions.tables import partition_file

    frame = read_report_columns(store, *partition_file(pk), columns=("index", *VALIDITY_COLUMNS))
    reasons, tokens, continued, cut = Counter(), 0, Counter(), 0
    by_index = None
    if prompts is not None:
        by_index = {p["index"]: p for p in prompts.select("index", "content_hash", "prompt_id").iter_rows(named=True)}
        reasons["missing"] += len(set(by_index) - set(frame["index"].to_list()))
    for row in frame.iter_rows(named=True):
        if by_index is not None:
            if row["index"] not in by_index:
                reasons["removed"] += 1
                continue
            if (reason := prompt_mismatch(row, by_index[row["index"]])) is not None:
                reasons[reason] += 1
                continue
        if (reason := invalid_reason(row, settings)) is not None:
            reasons[reason] += 1
            if reason == "cap lowered":
                cut += 1
            elif continues and continuable(row, settings, check_text=False):
                continued[int(row["max_output_tokens"])] += 1
            else:
                tokens += row.get("completion_tokens") or 0
    return +reasons, tokens, continued, cut


def continuation_tokens(report: dict | None, continued: Counter, new_cap: int) -> float | None:
    """Tokens the continuations of ``continued`` ({old cap: rows}) will generate up to ``new_cap``: each
    row E[min(L, new_cap) - cap | L > cap] under the truncation report's length fit (the
    ``extra_output_tokens`` of :func:`~dflash_assets.data.length_fits.predict_cap`). None without a report
    fit, or for a cap the report was not made at."""
    from dflash_assets.data.length_fits import fit_from_dict, predict_cap

    fit = (report or {}).get("advice", {}).get("fit")
    if not fit or not continued or set(continued) != {report.get("cap")}:
        return None
    cap, n = report["cap"], sum(continued.values())
    return predict_cap(fit_from_dict(fit), cap, float(report.get("truncation_rate") or 0.0), n, new_cap)[
        "extra_output_tokens"
    ]


def generation_time(records: dict[str, dg.EventLogRecord], meta: dict[str, dict]) -> tuple[float, float, int]:
    """``(seconds, output_tokens, requests)`` of the generation that made the current completions.

    A partition's generation is ``[t - wall_s, t]`` (``t``: its materialization time); the partitions of
    one run (a range run generates them side by side) count as the run's span from its first start to
    its last commit, and runs add up (the ``dflash_inference`` pool runs one at a time). Tokens are the
    ones generated in that run (``output_tokens_generated``; ``output_tok_per_s * wall_s`` or
    ``completion_tokens_total`` for older metadata), requests the ``requested`` rows (``rows`` without it):
    a partition whose rows were all cut to a lowered cap adds neither time nor tokens.
    """
    spans: dict[str, list[float]] = {}
    tokens = requests = 0.0
    for pk, record in records.items():
        m = meta[pk]
        wall = float(m.get("wall_s", 0.0) or 0.0)
        span = spans.setdefault(record.run_id or pk, [record.timestamp - wall, record.timestamp])
        span[0], span[1] = min(span[0], record.timestamp - wall), max(span[1], record.timestamp)
        rate = m.get("output_tok_per_s")
        if (
            m.get("output_tokens_generated") is not None
        ):  # a run that cut or continued rows made fewer than its table holds
            tokens += float(m["output_tokens_generated"])
        else:
            tokens += float(rate) * wall if rate else float(m.get("completion_tokens_total", 0) or 0)
        requests += int(m.get("requested", m.get("rows", 0)) or 0)
    return sum(end - start for start, end in spans.values()), tokens, int(requests)


def runs_in_progress(instance: dg.DagsterInstance, records: dict[str, dg.EventLogRecord]) -> list[dict]:
    """Progress of each STARTED run that has committed a completions partition, from the ``run_*``
    metadata of its newest commit (rows done / total over its range, req/s, output tok/s, slots in
    flight / capacity, ETA): ``[{"run_id", "range", "as_of", ...}]``, ``as_of`` the commit's Unix time."""

    started = {
        r.dagster_run.run_id for r in instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    }
    newest: dict[str, dg.EventLogRecord] = {}
    for record in records.values():
        if record.run_id in started and (
            record.run_id not in newest or record.storage_id > newest[record.run_id].storage_id
        ):
            newest[record.run_id] = record
    out = []
    for run_id, record in sorted(newest.items()):
        m = plain_metadata(record)
        if "run_rows_total" not in m:
            continue
        out.append(
            {
                "run_id": run_id,
                "range": m.get("run_partition_range"),
                "as_of": record.timestamp,
                **{
                    k: m.get(f"run_{k}")
                    for k in (
                        "rows_done",
                        "rows_total",
                        "req_per_s",
                        "output_tok_per_s",
                        "slots_in_flight",
                        "slots_capacity",
                        "eta_s",
                    )
                },
            }
        )
    return out


def collect_status(
    instance: dg.DagsterInstance, stages: Sequence[str] = STAGES, settings=None, store=None, continues: bool = False
) -> dict:
    """Everything the status command prints, as plain values.

    Args:
        instance: the Dagster instance.
        stages: partitioned stages to count.
        settings: the current generation settings (:class:`~dflash_assets.common.settings.GenerationSettings`);
            None leaves out what they would regenerate.
        store: the :class:`~dflash_assets.storage.store.Storage` holding the completions tables; needed with
            ``settings`` to count rows exactly (without it a touched partition counts wholly).
        continues: the configured servers continue rows a lower cap cut (SGLang, ``continue_truncated``):
            such rows count at the tokens their continuation is expected to make (truncation report fit).

    Returns a dict:

    - ``partitions``: number of registered ``prompt_index_ranges`` keys; ``prompts``: prompts they cover.
    - ``corpus_edit``: what the corpus's last build changed, ``new`` / ``changed`` / ``removed`` prompts, and
      ``to_request``: completions still to request for prompts new or changed and for partitions not done
      (empty for a corpus built before stable indices); ``completions.regenerate.removed``: stored rows of
      removed prompts the run drops (no request).
    - ``stages``: ``{asset_name: stage_counts(...)}`` for each partitioned stage.
    - ``pools``: :func:`pool_usage` of the inference and GPU pools.
    - ``completions``: ``rows_total`` (prompts), ``rows_done`` (rows of *done* partitions valid under
      ``settings``), ``rows_remaining`` = rows_total - rows_done (prompts of every failed, in-progress or
      missing partition, plus the rows ``settings`` regenerate), ``regenerate`` = ``{"rows", "partitions",
      "by_reason"}`` (those rows, in done partitions), ``tokens_done`` (``completion_tokens_total`` of done
      partitions), ``generation_s`` / ``tokens_generated`` / ``requests`` of :func:`generation_time`,
      ``tokens_per_s`` and ``requests_per_s`` (over generation_s; None when no time was recorded),
      ``tokens_remaining_est`` (tokens; a remaining prompt at the mean tokens per done row, a row to
      regenerate at no less than its current length, a row to continue at
      :func:`continuation_tokens`, a row longer than a lowered cap at 0; None without a done row),
      ``regenerate["continued"]`` (rows to be continued), ``regenerate["cut_locally"]`` (rows to be cut to
      a lowered cap, no request) and ``eta_s`` =
      tokens_remaining_est / tokens_per_s (seconds; None when either is unknown).
    """
    from dflash_assets.common import config
    from dflash_assets.orchestration import freshness

    keys = list(instance.get_dynamic_partitions(prompt_ranges.name))
    corpus_meta = latest_metadata(instance, "prompt_corpus") or {}
    versions = corpus_meta.get("partition_versions")
    sizes = corpus_meta.get("partition_prompts") or {}
    mode = config.completions_mode()  # a partition made in the other mode is made again

    def partition_prompt_count(pk: str) -> int:  # stable indices leave gaps: the corpus's count, else the range's
        return int(sizes.get(pk, partition_rows(pk)))

    def reason_of(pk: str) -> str | None:
        return freshness.completions_reason(meta[pk], settings, (versions or {}).get(pk) if versions else None, mode)

    counts = {name: stage_counts(instance, name, keys) for name in stages}
    comp = counts.get(COMPLETIONS) or stage_counts(instance, COMPLETIONS, keys)
    done = comp["done_keys"]
    all_records = latest_records(instance, COMPLETIONS, keys)
    records = {pk: all_records[pk] for pk in done if pk in all_records}
    meta = {pk: plain_metadata(r) for pk, r in records.items()}
    rows_of = {pk: int(meta.get(pk, {}).get("rows", partition_prompt_count(pk)) or 0) for pk in done}
    regen = (
        _regeneration(done, meta, rows_of, reason_of, versions, settings, store, continues)
        if settings is not None
        else _Regeneration()
    )
    not_done = comp["failed_keys"] + comp["in_progress_keys"] + comp["missing_keys"]
    edit = {k: int(corpus_meta[f"prompts_{k}"]) for k in ("new", "changed", "removed") if f"prompts_{k}" in corpus_meta}
    if edit:  # what the corpus's last build changed, and what it costs: prompts still without a valid row for them
        edit["to_request"] = sum(partition_prompt_count(pk) for pk in not_done) + sum(
            v for k, v in regen.by_reason.items() if k in ("missing", "prompt changed", "prompt unknown")
        )
    return {
        "partitions": len(keys),
        "prompts": sum(partition_prompt_count(pk) for pk in keys),
        "corpus_edit": edit,
        "runs_in_progress": runs_in_progress(instance, all_records),
        "held": held_partitions(instance, keys),  # {pk: "failed check <asset>.<check>"}: nothing after it runs
        "stages": counts,
        "pools": pool_usage(instance),
        "completions": _completions_figures(
            records,
            meta,
            rows_of,
            regen,
            rows_total=sum(partition_prompt_count(pk) for pk in keys),
            rows_not_done=sum(partition_prompt_count(pk) for pk in not_done),
            cap=settings.max_output_tokens if settings is not None else None,
        ),
    }


@dataclass
class _Regeneration:
    """What the current settings make again in done partitions: rows by reason and the partitions holding them,
    the tokens that costs, rows continued (by their current cap) or cut to a lowered cap, and stored rows of
    removed prompts (dropped, no request)."""

    by_reason: Counter = field(default_factory=Counter)
    partitions: list[str] = field(default_factory=list)
    tokens: float = 0.0
    to_continue: Counter = field(default_factory=Counter)
    to_cut: int = 0
    removed: int = 0

    @property
    def rows(self) -> int:
        return sum(self.by_reason.values())


def _regeneration(done, meta, rows_of, reason_of, versions, settings, store, continues: bool) -> _Regeneration:
    """:class:`_Regeneration` of the ``done`` partitions under ``settings``: judged row by row from the stored
    tables when ``store`` is given (a partition touched as a whole otherwise, and an on-policy one always); a
    row to regenerate costs no less than the mean tokens per done row, a continued row its expected
    continuation (the truncation report's fit, else its current length)."""
    from dflash_assets.orchestration import freshness

    tokens_done = sum(int(m.get("completion_tokens_total", 0) or 0) for m in meta.values())
    mean_tokens = tokens_done / sum(rows_of.values()) if sum(rows_of.values()) else None
    regen = _Regeneration()
    for pk in done:
        if pk not in meta or (reason := reason_of(pk)) is None:
            continue
        if store is None or meta[pk].get("mode") == "on_policy":  # on-policy turns: made again as a whole
            reasons, tokens, continued, cut = Counter({reason: rows_of[pk]}), 0, Counter(), 0
        else:
            prompts = None
            if freshness.prompts_reason(meta[pk], (versions or {}).get(pk) if versions else None):
                from dflash_assets.stages.prompts import CORPUS_FILE

                prompts = store.read_parquet(
                    *CORPUS_FILE, columns=["index", "content_hash", "prompt_id"], index_ranges=[key_range(pk)]
                )
            reasons, tokens, continued, cut = invalid_rows(store, pk, settings, continues, prompts)
            regen.removed += reasons.pop("removed", 0)
        if reasons:
            regen.by_reason.update(reasons)
            regen.partitions.append(pk)
            n = sum(reasons.values()) - sum(continued.values()) - cut
            regen.tokens += max(tokens, n * (mean_tokens or 0.0))
            regen.to_continue.update(continued)
            regen.to_cut += cut
    if regen.to_continue:
        from dflash_assets.assets.truncation import REPORT_DIR

        report = None
        try:
            if store.exists(REPORT_DIR, "report.json"):
                report = store.read_json(REPORT_DIR, "report.json")
        except Exception:
            report = None
        estimate = continuation_tokens(report, regen.to_continue, settings.max_output_tokens)
        # without a fit: each continued row at its current length (what a whole regeneration would cost at least)
        regen.tokens += estimate if estimate is not None else sum(cap * n for cap, n in regen.to_continue.items())
    return regen


def _completions_figures(
    records, meta, rows_of, regen: _Regeneration, *, rows_total: int, rows_not_done: int, cap: int | None
) -> dict:
    """``collect_status``'s ``completions``: rows done and remaining, the measured rates, the tokens remaining
    and the ETA (see its docstring)."""
    tokens_done = sum(int(m.get("completion_tokens_total", 0) or 0) for m in meta.values())
    generation_s, tokens_generated, requests = generation_time(records, meta)
    mean_tokens = tokens_done / sum(rows_of.values()) if sum(rows_of.values()) else None
    rows_remaining = rows_not_done + regen.rows
    tokens_per_s = tokens_generated / generation_s if generation_s > 0 else None
    requests_per_s = requests / generation_s if generation_s > 0 else None
    new_rows = rows_remaining - regen.rows
    tokens_remaining = new_rows * mean_tokens + regen.tokens if mean_tokens is not None else None
    eta_s = tokens_remaining / tokens_per_s if tokens_remaining is not None and tokens_per_s else None
    if rows_remaining == 0:
        tokens_remaining, eta_s = 0.0, 0.0
    return {
        "rows_total": rows_total,
        "rows_done": sum(rows_of.values()) - regen.rows - regen.removed,
        "tokens_done": tokens_done,
        "generation_s": round(generation_s, 3),
        "tokens_generated": round(tokens_generated),
        "requests": requests,
        "tokens_per_s": tokens_per_s,
        "requests_per_s": requests_per_s,
        "rows_remaining": rows_remaining,
        "regenerate": {
            "rows": regen.rows,
            "partitions": regen.partitions,
            "by_reason": dict(sorted(regen.by_reason.items())),
            "continued": sum(regen.to_continue.values()),
            "cut_locally": regen.to_cut,
            "removed": regen.removed,
        },
        "cap": cap,
        "tokens_remaining_est": tokens_remaining,
        "eta_s": eta_s,
    }


def current_settings_and_store():
    """The active config's generation settings and storage (``$DFLASH_CONFIG``), or ``(None, None, error)``."""
    try:
        from dflash_assets.common.config import resource_fields
        from dflash_assets.stages.resources.generation import configured_settings
        from dflash_assets.stages.resources.storage import resolved_storage

        settings = configured_settings()  # with the servers' context: prompts set aside as too long are judged by it
        store = resolved_storage(resource_fields("storage")).open()
        return settings, store, None
    except Exception as exc:
        return None, None, f"{type(exc).__name__}: {exc}"


def config_continues_cut_rows() -> bool:
    """Whether the active config's inference servers continue rows a lower cap cut (SGLang and
    ``continue_truncated``); False when the config does not load."""
    try:
        from dflash_assets.common.config import resource_fields
        from dflash_assets.stages.resources.inference import InferenceServerResource

        inference = InferenceServerResource(**resource_fields("inference"))
        return inference.client.continue_truncated and inference.backend() == "sglang"
    except Exception:
        return False


def corpus_preview(instance: dg.DagsterInstance, store) -> str | None:
    """A line previewing the next corpus build when the prompt files or the corpus config changed since the
    last one (None when unchanged or never built): new, changed and removed prompts, and the completions
    the run will request for them (prompts at an index the last corpus did not have; stable indices keep
    every other prompt's rows). Reads the prompt files (as the build does) without writing anything."""
    from dflash_assets.assets.prompts import corpus_fingerprint
    from dflash_assets.common.config import op_config, resource_fields
    from dflash_assets.data.prompt_index import stable_corpus
    from dflash_assets.data.shapes import build_corpus
    from dflash_assets.orchestration import freshness
    from dflash_assets.stages.prompts import CORPUS_FILE, PromptCorpusConfig
    from dflash_assets.stages.resources.storage import resolved_storage

    meta = latest_metadata(instance, "prompt_corpus")
    if meta is None or store is None or not store.exists(*CORPUS_FILE):
        return None
    config = PromptCorpusConfig(**((op_config("prompt_corpus")["ops"].get("prompt_corpus") or {}).get("config") or {}))
    resource = resolved_storage(resource_fields("storage"))
    reason = freshness.corpus_reason(meta, corpus_fingerprint(config, resource))
    if reason is None:
        return None
    previous = store.read_parquet(*CORPUS_FILE, columns=["index", "content_hash", "prompt_id"])
    result = build_corpus(config.sources, resource.source_storage_options, config.read_limits(), turns=config.turns)
    built = stable_corpus(store, result.corpus, config.partition_size, config.max_prompts, previous)
    had = set(previous["index"].to_list())
    to_request = sum(1 for i in built.corpus["index"].to_list() if i not in had)
    e = built.edits
    return (
        f"{reason}: the next run builds the corpus again: {e.new} new, {e.changed} changed, {e.removed} removed "
        f"prompts, {e.kept} unchanged (they keep their index and rows); it will request {to_request} completions "
        f"for them, in {len(built.keys)} partitions"
    )


def print_status(instance: dg.DagsterInstance | None = None, pilot: str | None = None) -> int:
    """Print :func:`~dflash_assets.app.status_lines.format_status` for ``instance`` (default:
    ``DagsterInstance.get()``) under the active config's generation settings, then the cost table and forecast
    (from the ``pilot`` range ``FIRST...LAST`` when given, :mod:`dflash_assets.app.cost_report`); returns exit
    code 0."""
    settings, store, error = current_settings_and_store()
    if error:
        print(
            f"note: could not load the config's generation settings and storage ({error}); rows the settings "
            "would regenerate are not counted"
        )
    instance = instance or dg.DagsterInstance.get()
    status = collect_status(
        instance, settings=settings, store=store, continues=settings is not None and config_continues_cut_rows()
    )
    try:
        status["corpus_preview"] = corpus_preview(instance, store)
    except Exception as exc:
        status["corpus_preview"] = (
            f"note: could not preview the next corpus build ({type(exc).__name__}: {str(exc)[:300]})"
        )
    print(format_status(status))
    from dflash_assets.app.cost_report import configured_cost_text

    print(configured_cost_text(instance, store, pilot))
    return 0
