"""Forecast against actual: ``cost/report.json`` and ``cost/forecast_vs_actual.png`` under the storage root.

The first forecast made for a corpus (:func:`~dflash_assets.stages.forecast.collect_forecast`, from a pilot or
the first partitions) is kept in the report as ``forecast``: it is the forecast made before the rest of
the run. Every later write keeps it and puts beside it what each stage measured since (the per-stage cost
table, :mod:`dflash_assets.app.cost_table`), figure by figure, with whether the measured figure lies inside
the forecast's 95% interval. A forecast for another corpus size replaces it (the old one moves to
``previous_forecast``); delete the report to forecast afresh.

Written by ``status``, by ``python -m dflash_assets run`` before it generates (:func:`keep_forecast`) and
at its end (atomic: the storage's writes are temp + rename, or one PUT on S3).
"""

from __future__ import annotations

import time

REPORT_DIR = "cost"
REPORT = (REPORT_DIR, "report.json")
PLOT = (REPORT_DIR, "forecast_vs_actual.png")


def forecast_figures(f: dict) -> dict[str, dict[str, dict]]:
    """``{stage: {figure: {point, low, high}}}``: what a forecast says each stage will measure in all."""
    out: dict[str, dict[str, dict]] = {"completions": dict(f["completions_whole"])}
    if t := f.get("training"):
        out["dflash_drafter"] = {"device_s": t["device_s"], "wall_s": t["wall_s"]}
    return out


def actual_figures(costs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """``{stage: {figure: value}}`` from :func:`~dflash_assets.app.cost_table.stage_costs`: device-seconds,
    generated tokens and generating seconds (completions), device and wall seconds (training)."""
    out = {}
    if c := costs.get("completions"):
        out["completions"] = {"device_s": c["device_s"], "tokens_out": c["tokens_out"], "generating_s": c["wall_s"]}
    if c := costs.get("dflash_drafter"):
        out["dflash_drafter"] = {"device_s": c["device_s"], "wall_s": c["wall_s"]}
    return out


def compare(forecast: dict, actual: dict[str, dict[str, float]], complete: bool) -> list[dict]:
    """One row per figure both sides have: stage, figure, forecast point/low/high, actual, and ``within``
    (actual inside [low, high]; None until the run is ``complete``: a part is not the whole)."""
    rows = []
    for stage, figures in forecast_figures(forecast).items():
        for name, iv in figures.items():
            if name not in actual.get(stage, {}):
                continue
            value = actual[stage][name]
            within = (iv["low"] <= value <= iv["high"]) if complete else None
            rows.append(
                {
                    "stage": stage,
                    "figure": name,
                    **{f"forecast_{k}": v for k, v in iv.items()},
                    "actual": value,
                    "within": within,
                }
            )
    return rows


def build_report(previous: dict | None, forecast: dict | None, costs: dict[str, dict], prompts_done: int) -> dict:
    """The report: the kept forecast (``previous``'s, unless none or for another corpus size; a forecast
    with no prompt left is never kept), the measured cost per stage, and :func:`compare`'s rows
    (``complete`` when ``prompts_done`` covers the corpus)."""
    kept = (previous or {}).get("forecast")
    report: dict = {"generated_at": time.time(), "stages": costs}
    if forecast is not None and not forecast.get("prompts_left"):
        forecast = None  # made with nothing left to run: it would only restate the measurement
    if kept is None or (forecast is not None and kept.get("prompts_total") != forecast.get("prompts_total")):
        if kept is not None:
            report["previous_forecast"] = kept
        kept = None if forecast is None else {**forecast, "made_at": time.time()}
    report["forecast"] = kept
    if kept is not None:
        complete = prompts_done >= kept["prompts_total"]
        report["complete"] = complete
        report["forecast_vs_actual"] = compare(kept, actual_figures(costs), complete)
    return report


def comparison_png(rows: list[dict]) -> bytes:
    """Each figure's forecast (point, 95% interval as an error bar) beside its measured value, as a share
    of the forecast point (1.0 = as forecast)."""
    from dflash_assets.common.figures import figure_png_bytes, new_figure

    fig, ax = new_figure((7.0, 3.5))
    labels = [f"{r['stage']}\n{r['figure']}" for r in rows]
    for i, r in enumerate(rows):
        point = r["forecast_point"] or 1.0
        ax.errorbar(
            [i], [1.0], yerr=[[1 - r["forecast_low"] / point], [r["forecast_high"] / point - 1]], fmt="o", color="C0"
        )
        ax.plot([i], [r["actual"] / point], "x", color="C3", markersize=10)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_ylabel("share of the forecast")
    ax.set_title("forecast (o, 95% interval) vs measured (x)")
    return figure_png_bytes(fig)


def write_cost_report(store, forecast: dict | None, costs: dict[str, dict], prompts_done: int) -> dict:
    """Build the report over the one stored (:func:`build_report`), write it and its plot; returns it."""
    previous = store.read_json(*REPORT) if store.exists(*REPORT) else None
    report = build_report(previous, forecast, costs, prompts_done)
    store.write_json(report, *REPORT)
    if report.get("forecast_vs_actual"):
        store.write_bytes(comparison_png(report["forecast_vs_actual"]), *PLOT)
    return report


def format_comparison(report: dict) -> str:
    """Text lines of the report's forecast-vs-actual rows (empty when there is no forecast)."""
    rows = report.get("forecast_vs_actual") or []
    if not rows:
        return ""
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime(report["forecast"]["made_at"]))
    lines = [f"== forecast (made {made}) vs measured ==" + ("" if report.get("complete") else " (run not complete)")]
    for r in rows:
        mark = {True: "inside", False: "OUTSIDE", None: "so far"}[r["within"]]
        lines.append(
            f"{r['stage']:<16}{r['figure']:<14}forecast {r['forecast_point']:,.1f} [{r['forecast_low']:,.1f} .. "
            f"{r['forecast_high']:,.1f}]  measured {r['actual']:,.1f}  {mark}"
        )
    return "\n".join(lines)


def cost_and_forecast(
    instance,
    store,
    inference,
    device_hour_usd: float | None,
    pilot_keys: list[str] | None = None,
    bytes_per_token: int | None = None,
) -> str:
    """What ``status`` and the run's summary print after their own lines: the per-stage cost table, the
    forecast for the whole corpus, and the forecast made before against what was measured; writes
    ``cost/report.json`` and its plot when ``store`` is given."""
    from dflash_assets.app.cost_table import format_cost_table, stage_costs
    from dflash_assets.stages.forecast import collect_forecast, corpus_prompts, format_forecast, rows_done

    costs = stage_costs(instance)
    total = corpus_prompts(instance)
    truncation = None
    if store is not None and store.exists("truncation_report", "report.json"):
        truncation = store.read_json("truncation_report", "report.json")
    forecast = (
        collect_forecast(instance, total, inference, store, pilot_keys, truncation, bytes_per_token)
        if inference
        else None
    )
    parts = [format_cost_table(costs, device_hour_usd), format_forecast(forecast, device_hour_usd)]
    if store is not None and (costs or forecast is not None):  # nothing measured yet: nothing to write
        report = write_cost_report(store, forecast, costs, rows_done(instance))
        parts += [format_comparison(report), f"cost report: {store.uri(*REPORT)}"]
    return "\n".join(p for p in parts if p)


def pilot_keys(instance, spec: str | None) -> list[str] | None:
    """The partition keys of ``FIRST...LAST`` (or one key) among the registered ones; None for no spec.

    Raises:
        ValueError: a key that is not registered (the message lists where to find them).
    """
    if not spec:
        return None
    from dflash_assets.orchestration.partitions import prompt_ranges

    keys = sorted(instance.get_dynamic_partitions(prompt_ranges.name))
    first, _, last = spec.partition("...")
    last = last or first
    for key in (first, last):
        if key not in keys:
            raise ValueError(f"--pilot {spec}: no partition {key!r} (`python -m dflash_assets status` lists the keys)")
    return [k for k in keys if first <= k <= last]


def configured_cost_text(instance, store, pilot: str | None = None) -> str:
    """:func:`cost_and_forecast` with the active config's inference servers and ``resources.cost`` price; a
    note instead of the forecast when the config's inference section does not load."""
    from dflash_assets.app.cost_table import configured_price
    from dflash_assets.common.config import resource_fields
    from dflash_assets.stages.resources.inference import InferenceServerResource

    try:
        inference = InferenceServerResource(**resource_fields("inference"))
    except Exception as exc:  # the table still prints; the forecast needs the servers
        inference = None
        note = f"note: no forecast: the config's inference servers do not load ({type(exc).__name__}: {exc})"
    else:
        note = ""
    text = cost_and_forecast(
        instance, store, inference, configured_price(), pilot_keys(instance, pilot), configured_bytes_per_token()
    )
    return "\n".join(p for p in (text, note) if p)


def keep_forecast(instance, store, inference) -> str | None:
    """Before a run generates: keep the forecast from what is measured so far in ``cost/report.json`` when
    the report keeps none yet (:func:`build_report`), so the run's end compares against a forecast made
    before it. Returns a note when that failed (the run goes on: a report never stops it), else None."""
    from dflash_assets.app.cost_table import stage_costs
    from dflash_assets.stages.forecast import collect_forecast, corpus_prompts, rows_done

    try:
        forecast = collect_forecast(instance, corpus_prompts(instance), inference, store)
        if forecast is not None:
            write_cost_report(store, forecast, stage_costs(instance), rows_done(instance))
    except Exception as exc:
        return f"note: the cost forecast was not kept ({type(exc).__name__}: {str(exc)[:300]})"
    return None


def configured_bytes_per_token(model_path: str | None = None) -> int | None:
    """Hidden-state bytes per token (:func:`~dflash_assets.dflash.target.features.bytes_per_token`: layers x
    hidden x 2 + 5) of the target at ``model_path`` (default: the active config's ``target_model.model_path``)
    with ``ops.hidden_states.config.target_layer_ids`` (default: 5 layers); None without a model directory
    (the local CPU model is not made just for a forecast) or when its config.json does not read."""
    try:
        from dflash_assets.common.config import op_config, resource_fields
        from dflash_assets.dflash.target.features import bytes_per_token
        from dflash_assets.stages.storage_plan import target_shape

        path = model_path if model_path is not None else resource_fields("target_model").get("model_path")
        if not path:
            return None
        ids = ((op_config("hidden_states")["ops"].get("hidden_states") or {}).get("config") or {}).get(
            "target_layer_ids"
        )
        layer_ids, hidden = target_shape(path, ids or None)
        return bytes_per_token(len(layer_ids), hidden, 2)
    except Exception:
        return None
