"""The whole run forecast from the partitions already measured (or a pilot range), with intervals.

Sampling unit: a prompt. For each per-prompt quantity y (generated tokens, slot-seconds = a request's
latency) the measured partitions give n rows, sum y and sum y^2 (``cost_*`` metadata of
:class:`~dflash_assets.common.cost.GenerationMeter`). The mean per prompt is ybar = sum y / n; its standard error is
the larger of

- the row-level one, s / sqrt(n) (s^2 = (sum y^2 - n ybar^2) / (n - 1)), and
- with k >= 2 partitions, the between-partition one of the ratio estimator,
  sqrt(sum_j (Y_j - ybar n_j)^2 / (k (k - 1))) / nbar (Y_j, n_j: partition j's sum and rows),

so partitions that differ more than their rows suggest (another source, another cap) widen it. The 95%
interval is ybar +- t(0.975, df) x se (df = n - 1 or k - 1, whichever gave the se), times the prompts left.

Generation wall on the configured servers (seconds) = start-up + R x slot-s per prompt / slots + drain:
R prompts streamed through ``servers x max_running_requests`` slots kept busy (one range run), plus the
run's end, when slots empty while its last long requests finish. The drain is 0 at the low end of the
interval and, at the high end, the largest measured one (a run's generating wall - its slot-seconds /
its slots). Device-seconds = configured devices x (that wall - start-up). Assumes the measured rows'
per-request speed: the same ``max_running_requests`` and model on the configured servers.

Other figures scale with the same per-prompt means: hidden-state storage = prompts x tokens per row x the storage
plan's bytes per token (:mod:`dflash_assets.stages.storage_plan`); training steps = the run's ``max_steps`` when it
set one (a fixed schedule), else measured steps x prompts / rows it was fed (trained on and held out), time at the
measured seconds per step, widened by the relative interval of tokens per prompt; a cap change's device-hours = cap
advice's tokens to generate (:func:`dflash_assets.data.truncation.cap_advice`) scaled to the corpus x measured
device-seconds per token.
"""

from __future__ import annotations

import math

import dagster as dg

from dflash_assets.orchestration.history import latest_metadata, latest_records, plain_metadata

# t(0.975, df) for df = 1..30 (two-sided 95%); above 30 the normal 1.96 is within 2%
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


#: partitions whose file sizes the storage forecast reads (two requests each on S3), the first in key order
SIZE_SAMPLE = 20


def t975(df: int) -> float:
    """Student's t quantile 0.975 with ``df`` degrees of freedom (table to 30, then 1.96); inf for df < 1."""
    if df < 1:
        return math.inf
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_interval(parts: list[tuple[int, float, float]]) -> tuple[float, float]:
    """``(mean, half_width)`` of a per-prompt quantity over partitions ``(rows, sum, sum_of_squares)``:
    95% t-interval with the larger of the row-level and between-partition standard errors (module doc)."""
    parts = [p for p in parts if p[0] > 0]
    n = sum(p[0] for p in parts)
    if n == 0:
        return 0.0, math.inf
    total = sum(p[1] for p in parts)
    mean = total / n
    var = max(0.0, (sum(p[2] for p in parts) - n * mean * mean) / (n - 1)) if n > 1 else math.inf
    se, df = math.sqrt(var / n), n - 1
    k = len(parts)
    if k >= 2:
        nbar = n / k
        se_part = math.sqrt(sum((y - mean * m) ** 2 for m, y, _ in parts) / (k * (k - 1))) / nbar
        if se_part > se:
            se, df = se_part, k - 1
    return mean, t975(df) * se


def _iv(point: float, half: float) -> dict:
    return {"point": point, "low": max(0.0, point - half), "high": point + half}


def current_partitions(instance: dg.DagsterInstance) -> list[str] | None:
    """The partition keys of the corpus as it is now: those of ``prompt_corpus``'s latest ``partition_prompts``
    metadata. None before any corpus build recorded them (then every recorded partition counts). A key of an
    earlier build (another ``partition_size``, prompts removed) is not among them: its rows are not done."""
    sizes = (latest_metadata(instance, "prompt_corpus") or {}).get("partition_prompts")
    return None if sizes is None else sorted(sizes)


def _current_records(instance: dg.DagsterInstance, asset: str, keys: list[str] | None) -> dict:
    """:func:`latest_records` of ``asset`` limited to ``keys`` (None: every partition); {} for no key."""
    return {} if keys is not None and not keys else latest_records(instance, asset, keys)


def rows_done(instance: dg.DagsterInstance, keys: list[str] | None = None) -> int:
    """Rows of the materialized completions partitions of ``keys`` (default :func:`current_partitions`; their
    latest materializations' ``rows``)."""
    keys = current_partitions(instance) if keys is None else keys
    return sum(
        int((plain_metadata(r) or {}).get("rows") or 0)
        for r in _current_records(instance, "completions", keys).values()
    )


def measured_partitions(instance: dg.DagsterInstance, keys: list[str] | None = None) -> dict[str, dict]:
    """``{pk: metadata}`` of the completions partitions whose latest materialization generated rows and
    recorded their cost (``cost_rows`` > 0), with ``run_id`` added; ``keys`` limits them (a pilot range, the
    current partitions)."""
    out = {}
    for pk, record in _current_records(instance, "completions", keys).items():
        meta = plain_metadata(record) or {}
        if (meta.get("cost_rows") or 0) > 0 and meta.get("cost_device_s") is not None:
            out[pk] = {**meta, "run_id": record.run_id}
    return out


def run_drains(measured: dict[str, dict]) -> list[float]:
    """Per run: generating wall - slot-seconds / slots (seconds), the measured cost of its end."""
    runs: dict[str, list[dict]] = {}
    for meta in measured.values():
        runs.setdefault(meta["run_id"], []).append(meta)
    drains = []
    for metas in runs.values():
        slots = max(int(m.get("run_slots_capacity") or 0) for m in metas) or 1
        wall = sum(float(m["cost_wall_s"]) for m in metas)
        drains.append(max(0.0, wall - sum(float(m["cost_slot_s"]) for m in metas) / slots))
    return drains


def generation_forecast(measured: dict[str, dict], prompts_left: int, devices: int, slots: int) -> dict:
    """Tokens, wall seconds and device-seconds of generating ``prompts_left`` prompts on ``devices`` devices
    with ``slots`` slots in all, from ``measured`` (:func:`measured_partitions`), each as ``{point, low,
    high}`` (95%; module doc). Also the per-prompt means and the measured device-seconds per token."""
    metas = list(measured.values())
    tok, tok_half = mean_interval([(m["cost_rows"], m["cost_tokens_out"], m["cost_tokens_out_sq"]) for m in metas])
    slot, slot_half = mean_interval([(m["cost_rows"], m["cost_slot_s"], m["cost_slot_s_sq"]) for m in metas])
    # nothing left: no start-up, no drain (the whole is then what was measured)
    drain = max(run_drains(measured), default=0.0) if prompts_left else 0.0
    startups = sorted(float(m.get("cost_startup_s") or 0.0) for m in metas)
    startup = startups[len(startups) // 2] if startups and prompts_left else 0.0
    busy = prompts_left * slot / max(1, slots)
    busy_half = prompts_left * slot_half / max(1, slots)
    low, high = max(0.0, busy - busy_half), busy + busy_half + drain
    gen = {"point": busy + drain / 2, "low": low, "high": high}
    device_s = sum(float(m["cost_device_s"]) for m in metas)
    tokens = sum(int(m["cost_tokens_out"]) for m in metas)
    return {
        "prompts": prompts_left,
        "tokens_per_prompt": _iv(tok, tok_half),
        "slot_s_per_prompt": _iv(slot, slot_half),
        "tokens_to_generate": _iv(prompts_left * tok, prompts_left * tok_half),
        "wall_s": {k: v + startup for k, v in gen.items()},
        "device_s": {k: devices * v for k, v in gen.items()},
        "startup_s": startup,
        "drain_s": drain,
        "device_s_per_token": device_s / tokens if tokens else None,
        "devices": devices,
        "slots": slots,
    }


def scaled(iv: dict, factor: float) -> dict:
    """``iv`` (``{point, low, high}``) times ``factor``."""
    return {k: v * factor for k, v in iv.items()}


def storage_forecast(
    instance: dg.DagsterInstance,
    prompts: int,
    tokens_per_row: dict,
    store=None,
    bytes_per_token: int | None = None,
    keys: list[str] | None = None,
) -> dict:
    """Bytes by stage for ``prompts`` prompts, each ``{point, low, high}``: completions and tokenized tables at
    their measured bytes per row (file sizes of up to :data:`SIZE_SAMPLE` materialized partitions; needs
    ``store``; interval: that of tokens per row, relative), hidden states at ``tokens_per_row`` (tokenized
    tokens per row, prompt + completion) x the storage plan's bytes per token (recorded by
    ``hidden_states``; before any is extracted: ``bytes_per_token``, from the configured target, else none).
    ``keys``: the partitions read (None: every one recorded)."""
    from dflash_assets.stages.completions.tables import partition_file
    from dflash_assets.stages.tokenized import tokenized_file

    out: dict[str, dict] = {}
    band = scaled(tokens_per_row, 1 / tokens_per_row["point"]) if tokens_per_row["point"] else tokens_per_row
    for stage, file_of in (("completions", partition_file), ("tokenized_sequences", tokenized_file)):
        rows = size = sampled = 0
        for pk, meta in sorted(_current_records(instance, stage, keys).items()):
            m = plain_metadata(meta) or {}
            if sampled < SIZE_SAMPLE and store is not None and m.get("rows") and store.exists(*file_of(pk)):
                rows, size, sampled = rows + int(m["rows"]), size + store.size(*file_of(pk)), sampled + 1
        if rows:  # text and token columns grow with the tokens per row: the same relative interval
            out[stage] = scaled(band, prompts * size / rows)
    hidden = list(_current_records(instance, "hidden_states", keys).values())
    per_token = [(plain_metadata(r) or {}).get("bytes_per_token_expected") for r in hidden]
    per_token = [p for p in per_token if p] or ([bytes_per_token] if bytes_per_token else [])
    if per_token:
        out["hidden_states"] = scaled(tokens_per_row, prompts * per_token[-1])
    return out


def training_forecast(instance: dg.DagsterInstance, prompts: int, relative_half: float) -> dict | None:
    """Steps, seconds and device-seconds of training on ``prompts`` rows, from the latest ``dflash_drafter``
    run (None without one that trained): its ``max_steps`` when set (no interval), else steps x prompts / rows
    fed (trained on plus held out), at its seconds per step, the interval the point x (1 +- ``relative_half``),
    the relative half-width of tokens per prompt."""
    meta = latest_metadata(instance, "dflash_drafter") or {}
    steps, rows, ran = meta.get("steps"), meta.get("train_rows"), meta.get("steps_this_run")
    if not steps or not rows or not ran or not meta.get("cost_wall_s"):
        return None
    s_per_step = float(meta["cost_wall_s"]) / ran
    if meta.get("max_steps"):  # a fixed schedule: the corpus's size does not change it
        point, band = float(meta["max_steps"]), {"point": 1.0, "low": 1.0, "high": 1.0}
    else:  # steps per row the run was fed (trained on plus held out), times the corpus's prompts
        point = steps * prompts / (rows + int(meta.get("heldout_rows") or 0))
        band = {"point": 1.0, "low": max(0.0, 1 - relative_half), "high": 1 + relative_half}
    devices = int(meta.get("cost_devices") or 1)
    return {
        "steps": scaled(band, point),
        "wall_s": scaled(band, point * s_per_step),
        "device_s": scaled(band, point * s_per_step * devices),
        "device": meta.get("cost_device"),
        "s_per_step": s_per_step,
    }


def cap_change_forecast(report: dict | None, prompts: int, device_s_per_token: float | None) -> list[dict]:
    """Each cap advice candidate (truncation report) scaled to ``prompts``: tokens to generate and
    device-seconds at the measured device-seconds per generated token."""
    advice = (report or {}).get("advice") or {}
    rows = (report or {}).get("rows") or 0
    if not rows or device_s_per_token is None:
        return []
    factor = prompts / rows
    return [
        {
            "cap": c["cap"],
            "tokens_to_generate": c["tokens_to_generate"] * factor,
            "device_s": c["tokens_to_generate"] * factor * device_s_per_token,
        }
        for c in advice.get("candidates", [])
    ]


def configured_generation(inference) -> tuple[str, int, int]:
    """``(device kind, devices, slots)`` of the configured inference servers: :func:`~dflash_assets.common.cost.
    generation_devices` and ``max_running_requests`` x servers (URLs in external mode, 1 local)."""
    from dflash_assets.common.cost import generation_devices

    kind, devices, _ = generation_devices(inference)
    servers = {
        "sglang": inference.sglang.num_servers,
        "vllm": inference.vllm.num_servers,
        "external": max(1, len(inference.external.base_urls)),
    }.get(inference.mode, 1)
    return kind, devices, servers * inference.effective_max_running_requests()


def done_generation(instance: dg.DagsterInstance, keys: list[str] | None = None) -> dict:
    """``device_s``, ``wall_s`` (seconds) and ``tokens_out`` summed over the latest materialization of each
    completions partition of ``keys`` (None: every one, what :func:`~dflash_assets.app.cost_table.stage_costs`
    sums for completions)."""
    metas = [plain_metadata(r) or {} for r in _current_records(instance, "completions", keys).values()]
    return {
        "device_s": sum(float(m.get("cost_device_s") or 0.0) for m in metas),
        "wall_s": sum(float(m.get("cost_wall_s") or 0.0) for m in metas),
        "tokens_out": sum(int(m.get("cost_tokens_out") or 0) for m in metas),
    }


def measured_generation(measured: dict[str, dict]) -> tuple[str, int, int]:
    """``(device kind, devices, slots)`` of the latest measured partition's run (when no configured
    servers are at hand: the forecast is then for the servers that measured)."""
    meta = measured[max(measured)]
    return str(meta["cost_device"]), int(meta["cost_devices"]), int(meta.get("run_slots_capacity") or 1)


def collect_forecast(
    instance: dg.DagsterInstance,
    prompts_total: int,
    inference,
    store=None,
    pilot_keys: list[str] | None = None,
    truncation_report: dict | None = None,
    bytes_per_token: int | None = None,
) -> dict | None:
    """The whole corpus's forecast: what is done (measured) plus what is left (forecast from the measured
    partitions, or ``pilot_keys`` only), for ``prompts_total`` prompts on the configured ``inference``
    servers (None: on the servers of the latest measured run). None before any completions partition
    recorded its cost. Each figure ``{point, low, high}`` (95%; module doc); completions figures are of the
    whole corpus (done + left). ``bytes_per_token``: hidden-state bytes per token of the configured target
    (:func:`~dflash_assets.stages.storage_plan.target_shape`), used until a ``hidden_states`` partition
    records its own. Only the corpus's current partitions count (:func:`current_partitions`): after a
    ``partition_size`` change or a rebuild that dropped prompts, rows of keys gone are neither done nor measured."""
    keys = current_partitions(instance)
    if pilot_keys is not None:
        pilot_keys = [k for k in pilot_keys if keys is None or k in keys]
    measured = measured_partitions(instance, pilot_keys if pilot_keys is not None else keys)
    if not measured:
        return None
    servers = configured_generation(inference) if inference is not None else measured_generation(measured)
    kind, devices, slots = servers
    done = done_generation(instance, keys)
    done_rows = rows_done(instance, keys)
    left = max(0, prompts_total - done_rows)
    gen = generation_forecast(measured, left, devices, slots)
    whole = {
        "tokens_out": {k: v + done["tokens_out"] for k, v in gen["tokens_to_generate"].items()},
        "device_s": {k: v + done["device_s"] for k, v in gen["device_s"].items()},
        "generating_s": {k: v / max(1, devices) + done["wall_s"] for k, v in gen["device_s"].items()},
    }
    tok = gen["tokens_per_prompt"]
    relative = (tok["high"] - tok["point"]) / tok["point"] if tok["point"] else 0.0
    rows = sum(m["cost_rows"] for m in measured.values())
    prompt_tokens = sum(int(m["cost_tokens_in"]) for m in measured.values()) / rows
    per_row = {k: v + prompt_tokens for k, v in tok.items()}
    return {
        "prompts_total": prompts_total,
        "prompts_done": done_rows,
        "prompts_left": left,
        "from_partitions": sorted(measured),
        "rows_measured": rows,
        "device": kind,
        "generation": gen,
        "completions_whole": whole,
        "storage_bytes": storage_forecast(instance, prompts_total, per_row, store, bytes_per_token, keys),
        "training": training_forecast(instance, prompts_total, relative),
        "cap_changes": cap_change_forecast(truncation_report, prompts_total, gen["device_s_per_token"]),
    }


def _device_word(kind: str) -> str:
    """What a device count counts: on a CPU the cores the servers may use (cost.generation_devices), not devices."""
    return "CPU core(s)" if kind == "CPU" else "device(s)"


def _fmt_iv(iv: dict, fmt) -> str:
    return f"{fmt(iv['point'])} [{fmt(iv['low'])} .. {fmt(iv['high'])}]"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def format_forecast(f: dict | None, device_hour_usd: float | None = None) -> str:
    """Text lines of :func:`collect_forecast` (``[point low .. high]``, 95%); simulated figures say so."""
    if f is None:
        return (
            "== forecast ==\nno completions partition of the current corpus has recorded its cost yet: "
            "run one (a pilot) first"
        )
    gen, whole, unit = f["generation"], f["completions_whole"], f"{f['device']}-h"

    def dh(s: float) -> str:
        usd = "" if device_hour_usd is None else f" (${s / 3600 * device_hour_usd:,.0f})"
        return f"{s / 3600:,.3f}{usd}"

    lines = [
        f"== forecast for the whole corpus: {f['prompts_total']:,} prompts ({f['prompts_done']:,} done, "
        f"{f['prompts_left']:,} left), from {len(f['from_partitions'])} measured partition(s), "
        f"{f['rows_measured']:,} rows; [95% interval] ==",
        f"tokens to generate (left)  {_fmt_iv(gen['tokens_to_generate'], lambda v: f'{v:,.0f}')}",
        f"generation wall (left)     {_fmt_iv(gen['wall_s'], _hours)} on {gen['devices']} {_device_word(f['device'])}, "
        f"{gen['slots']} "
        f"slots (start-up {gen['startup_s']:.0f} s, drain up to {gen['drain_s']:.0f} s)",
        f"device-hours, whole        {_fmt_iv(whole['device_s'], dh)} {unit}",
        f"generated tokens, whole    {_fmt_iv(whole['tokens_out'], lambda v: f'{v:,.0f}')}",
    ]
    from dflash_assets.stages.storage_plan import gb

    for stage, iv in f["storage_bytes"].items():  # a space even after the longest name, tokenized_sequences
        lines.append(f"storage {stage:<18} {_fmt_iv(iv, gb)}")
    if t := f.get("training"):
        lines.append(
            f"training steps             {_fmt_iv(t['steps'], lambda v: f'{v:,.0f}')}, "
            f"time {_fmt_iv(t['wall_s'], _hours)}"
            f" ({t['device']}, {t['s_per_step']:.3f} s/step measured)"
        )
    for c in f["cap_changes"]:
        lines.append(
            f"cap change to {c['cap']:<13}{c['tokens_to_generate']:,.0f} tokens to generate, {dh(c['device_s'])} {unit}"
        )
    if "simulated" in f["device"]:
        lines.append("  simulated: measured on the GPU-node simulator, not on a GPU")
    return "\n".join(lines)


def corpus_prompts(instance) -> int:
    """Prompts in the corpus: the sum of ``prompt_corpus``'s ``partition_prompts`` metadata (0 before it)."""
    return sum(
        int(v) for v in ((latest_metadata(instance, "prompt_corpus") or {}).get("partition_prompts") or {}).values()
    )


def forecast_markdown(instance, store, truncation_report: dict | None = None) -> str:
    """The forecast (:func:`~dflash_assets.stages.forecast.format_forecast`) on the servers that measured, as
    Markdown for an asset's UI metadata (``truncation_report`` shows it beside the cap advice it prices)."""
    try:
        forecast = collect_forecast(instance, corpus_prompts(instance), None, store, None, truncation_report)
    except Exception as exc:  # a figure for the UI never fails the asset showing it
        return f"no forecast: {type(exc).__name__}: {str(exc)[:300]}"
    return "```\n" + format_forecast(forecast) + "\n```"
