"""The end-of-run summary, read back from the assets' latest materialization metadata."""

from collections import Counter

import dagster as dg

from dflash_assets.automation import latest_metadata


def _meta(instance, key: str, pk: str) -> dict:
    return latest_metadata(instance, dg.AssetKey(key), pk) or {}


def _unpartitioned(instance, key: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    if event is None or event.asset_materialization is None:
        return {}
    return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}


def collect_summary(instance: dg.DagsterInstance, keys: list[str]) -> dict:
    """Numbers a user checks after a run, each taken from an asset's metadata (never recomputed)."""
    corpus = _unpartitioned(instance, "prompt_corpus")
    finish = Counter()
    comp_rows = tok_rows = loss_tokens = hs_bytes = hs_tokens = 0
    for pk in keys:
        c = _meta(instance, "completions", pk)
        finish.update(c.get("finish_reasons", {}))
        comp_rows += c.get("rows", 0)
        t = _meta(instance, "tokenized_sequences", pk)
        tok_rows += t.get("rows", 0)
        loss_tokens += t.get("loss_tokens", 0)
        h = _meta(instance, "hidden_states", pk)
        hs_bytes += h.get("bytes", 0) or 0
        hs_tokens += h.get("tokens", 0) or 0
    report = _unpartitioned(instance, "truncation_report")
    drafter = _unpartitioned(instance, "dflash_drafter")
    evaluation = _unpartitioned(instance, "drafter_evaluation")
    return {
        "prompts": corpus.get("num_prompts"), "duplicates": corpus.get("duplicates"), "rejected": corpus.get("rejected"),
        "partitions": len(keys), "corpus_path": corpus.get("path"),
        "completions": comp_rows, "finish_reasons": dict(sorted(finish.items())),
        "truncation_rate": report.get("truncation_rate"), "cap": report.get("cap"), "cap_advice": report.get("cap_advice"),
        "histogram_path": report.get("histogram_path"),
        "tokenized_rows": tok_rows, "loss_tokens": loss_tokens,
        "hidden_state_bytes": hs_bytes, "hidden_state_tokens": hs_tokens,
        "drafter_parameters": drafter.get("parameters"), "drafter_train_tokens": drafter.get("train_tokens"),
        "drafter_export": drafter.get("export_path"),
        "tau": evaluation.get("tau"), "tau_untrained": evaluation.get("tau_untrained"),
        "acceptance_png": evaluation.get("histogram_path"),
    }


def format_summary(s: dict) -> str:
    """The summary as aligned text lines."""
    def fmt(v):
        return "-" if v is None else v

    lines = [
        "== dflash-assets summary ==",
        f"prompts            {fmt(s['prompts'])} ({fmt(s['duplicates'])} duplicates, {fmt(s['rejected'])} rejected) in {s['partitions']} partitions",
        f"completions        {s['completions']} by finish_reason {s['finish_reasons']}",
        f"truncation         {fmt(s['truncation_rate'])} at cap {fmt(s['cap'])} tokens",
    ]
    if isinstance(s.get("cap_advice"), str) and s["cap_advice"]:
        lines += ["cap advice         " + line for line in s["cap_advice"].splitlines() if line.strip()]
    lines += [
        f"tokenized          {s['tokenized_rows']} rows, {s['loss_tokens']} loss tokens",
        f"hidden states      {s['hidden_state_bytes'] / 1e6:.1f} MB for {s['hidden_state_tokens']} tokens",
        f"drafter            {fmt(s['drafter_parameters'])} parameters, trained on {fmt(s['drafter_train_tokens'])} tokens",
        f"acceptance length  tau {fmt(s['tau'])} (untrained drafter: {fmt(s['tau_untrained'])})",
        f"corpus             {fmt(s['corpus_path'])}",
        f"length histogram   {fmt(s['histogram_path'])}",
        f"drafter export     {fmt(s['drafter_export'])}",
        f"acceptance plot    {fmt(s['acceptance_png'])}",
    ]
    return "\n".join(lines)
