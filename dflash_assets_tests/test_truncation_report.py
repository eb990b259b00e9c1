"""truncation_report: its numbers against an independent computation from the partition tables, the
histogram PNG (metadata and file), missing partitions, and cap advice on censored log-normal lengths."""

import base64
import io
import json
import math
import random
import struct
import zlib

import dagster as dg
import numpy as np
import polars as pl
import pytest

from dflash_assets.assets.truncation import REPORT_DIR, truncation_report
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.ranges import partition_keys
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.tables import partition_file
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_row(
    index: int,
    source: str,
    tokens: int | None,
    finish_reason: str | None,
    cap: int,
    *,
    reasoning: str | None = None,
    answer: str | None = "ok",
    error: str | None = None,
) -> dict:
    """One completions row (COMPLETIONS_SCHEMA) with the fields the report reads."""
    settings = GenerationSettings(max_output_tokens=cap)
    truncated_in_reasoning = error is None and finish_reason == "length" and reasoning is not None and not answer
    return {
        "index": index,
        "prompt_id": f"{source}:{index}",
        "source": source,
        "reasoning_content": reasoning,
        "content": None if error else (answer or ""),
        "finish_reason": finish_reason,
        "prompt_tokens": None if error else 20,
        "completion_tokens": tokens,
        "output_token_ids": None,
        "truncated_in_reasoning": truncated_in_reasoning,
        "empty_answer": error is None and not (answer or "").strip(),
        "max_output_tokens": cap,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": json.dumps(settings.model_dump(), sort_keys=True),
        "latency_s": 1.0,
        "server": "http://s0/v1",
        "attempts": 1,
        "error": error,
    }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (the (n-1)p rank rule, Hyndman & Fan type 7), plain Python."""
    v = sorted(values)
    rank = (len(v) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def materialize_report(instance, root, cap: int):
    result = dg.materialize(
        [truncation_report],
        instance=instance,
        resources={"storage": StorageResource(root=str(root)), "generation": GenerationResource(max_output_tokens=cap)},
    )
    assert result.success
    meta = result.asset_materializations_for_node("truncation_report")[0].metadata
    report = json.loads((root / REPORT_DIR / "report.json").read_text())
    return report, meta


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature and the chunk's CRC."""
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(kind + body)
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the file is complete
    return struct.unpack(">II", body[:8])


def synthetic_partitions(cap: int, seed: int = 3) -> dict[str, list[dict]]:
    """Three partitions of mixed rows: stop / length (some cut inside reasoning) / abort / error / empty answers."""
    rng = random.Random(seed)
    keys = partition_keys(60, 20)
    parts: dict[str, list[dict]] = {}
    for p, pk in enumerate(keys):
        rows = []
        for i in range(20):
            index, source = p * 20 + i, ("alpaca", "sharegpt")[i % 2]
            draw = rng.random()
            if draw < 0.05:
                rows.append(make_row(index, source, None, None, cap, answer=None, error="HTTP 500 after 5 attempts"))
            elif draw < 0.05 + 0.15 * (p + 1):  # truncation rate grows with the partition
                in_reasoning = rng.random() < 0.5
                rows.append(
                    make_row(
                        index,
                        source,
                        cap,
                        "length",
                        cap,
                        reasoning="step one",
                        answer=None if in_reasoning else "partial",
                    )
                )
            elif draw < 0.7:
                rows.append(
                    make_row(
                        index, source, rng.randint(5, cap), "stop", cap, answer="" if rng.random() < 0.2 else "done"
                    )
                )
            elif draw < 0.75:
                rows.append(make_row(index, source, rng.randint(1, cap), "abort", cap))
            else:
                rows.append(make_row(index, source, rng.randint(5, cap), "stop", cap))
        parts[pk] = rows
    return parts


def test_report_numbers_png_and_missing_partitions(tmp_path):
    cap = 64
    parts = synthetic_partitions(cap)
    keys = list(parts)
    written, missing = keys[:2], keys[2:]
    for pk in written:
        path = tmp_path.joinpath(*partition_file(pk))
        path.parent.mkdir(parents=True, exist_ok=True)
        rows_to_frame(parts[pk]).write_parquet(path)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, keys)
        report, meta = materialize_report(instance, tmp_path, cap)

    # independent numbers from the rows as plain Python
    rows = [dict(r, partition=pk) for pk in written for r in parts[pk]]
    ok = [r for r in rows if r["error"] is None]
    tokens = [r["completion_tokens"] for r in ok]
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1

    def rate(group: list[dict]) -> float:
        return sum(r["finish_reason"] == "length" for r in group) / len(group)

    assert report["rows"] == len(rows) and report["errors"] == len(rows) - len(ok) > 0
    assert report["finish_reasons"] == reasons and {"stop", "length", "abort"} <= set(reasons)
    assert report["truncation_rate"] == pytest.approx(rate(ok))
    for pk in written:
        assert report["per_partition"][pk]["rate"] == pytest.approx(rate([r for r in ok if r["partition"] == pk]))
        assert meta["truncation_rate_per_partition"].value[pk] == round(report["per_partition"][pk]["rate"], 4)
    for source in ("alpaca", "sharegpt"):
        group = [r for r in ok if r["source"] == source]
        assert report["per_source"][source]["rate"] == pytest.approx(rate(group))
        assert report["per_source"][source]["rows"] == len(group)
    ct = report["completion_tokens"]
    for q in (50, 90, 99):
        assert ct[f"p{q}"] == pytest.approx(percentile(tokens, q))
    assert ct["max"] == max(tokens) == cap
    in_reasoning = sum(
        r["finish_reason"] == "length" and r["reasoning_content"] is not None and not r["content"] for r in ok
    )
    assert report["truncated_in_reasoning"] == in_reasoning > 0
    assert report["empty_answer"] == sum(not (r["content"] or "").strip() for r in ok) > in_reasoning
    assert meta["truncation_rate"].value == round(rate(ok), 4)
    assert meta["finish_reasons"].value == reasons

    assert report["partitions_missing"] == missing and meta["partitions_missing"].value == len(missing)
    assert report["partitions_included"] == written

    # the histogram: an inline data:image/png in Markdown metadata, the same bytes as the stored file
    md = meta["histogram"].value
    assert md.startswith("![") and "](data:image/png;base64," in md and md.endswith(")")
    inline = base64.b64decode(md.split("base64,", 1)[1][:-1], validate=True)
    stored = (tmp_path / REPORT_DIR / "completion_lengths.png").read_bytes()
    assert inline == stored
    assert png_size(stored) == (700, 350)  # figsize 7 x 3.5 in at 100 dpi
    from PIL import Image

    Image.open(io.BytesIO(stored)).verify()


def test_report_fails_without_any_partition(tmp_path):
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, partition_keys(10, 5))
        result = dg.materialize(
            [truncation_report],
            instance=instance,
            raise_on_error=False,
            resources={
                "storage": StorageResource(root=str(tmp_path)),
                "generation": GenerationResource(max_output_tokens=8),
            },
        )
    assert not result.success


# ---------------------------------------------------------------- cap advice on known log-normal lengths

MU, SIGMA, CAP, N = math.log(300.0), 0.6, 400, 3000


def true_rate(cap: float) -> float:
    """P(L > cap) for ln L ~ N(MU, SIGMA^2)."""
    return 0.5 * math.erfc((math.log(cap) - MU) / (SIGMA * math.sqrt(2)))


def lognormal_rows(lengths: np.ndarray, cap: int, previous_cap: int | None = None) -> list[dict]:
    """Rows of lengths censored at ``cap``; with ``previous_cap``, rows that stopped under it keep it
    (carried over, as after a real cap raise) and only the rest carry ``cap``."""
    rows = []
    for i, length in enumerate(lengths.tolist()):
        if length > cap:
            rows.append(make_row(i, "lognormal", cap, "length", cap))
        else:
            made_at = previous_cap if previous_cap is not None and length <= previous_cap else cap
            rows.append(make_row(i, "lognormal", length, "stop", made_at))
    return rows


def test_cap_advice_90pct_interval_covers_the_truth():
    """Over 15 independent censored samples (45 intervals), the 90% intervals cover what re-running at the
    larger cap would show in >= 90% of cases, and they are not vacuous."""
    from dflash_assets.data.truncation import cap_advice

    n, covered, widths = 600, [], []
    for seed in range(100, 115):
        lengths = np.ceil(np.exp(np.random.default_rng(seed).normal(MU, SIGMA, n))).astype(int)
        frame = pl.DataFrame(
            {
                "completion_tokens": np.minimum(lengths, CAP),
                "finish_reason": np.where(lengths > CAP, "length", "stop"),
                "max_output_tokens": np.full(n, CAP),
            }
        )
        for cand in cap_advice(frame, CAP)["candidates"][:3]:  # 1.25x, 1.5x, 2x; doublings beyond vary by sample
            lo, hi = cand["truncation_rate_90ci"]
            covered.append(lo <= float(np.mean(lengths > cand["cap"])) <= hi)
            widths.append((hi - lo) / true_rate(cand["cap"]))
    # issue 16: the interval now keeps its promise (>= 90%; it holds model uncertainty: log-normal and Weibull)
    assert len(covered) == 45 and sum(covered) >= 41, sum(covered)
    assert max(widths) < 2.0 and float(np.mean(widths)) < 1.0  # relative width: informative, not everything


def write_partition(root, pk: str, rows: list[dict]) -> None:
    path = root.joinpath(*partition_file(pk))
    path.parent.mkdir(parents=True, exist_ok=True)
    rows_to_frame(rows).write_parquet(path)


def test_cap_advice_predicts_censored_lognormal_and_reports_prediction_vs_actual(tmp_path):
    rng = np.random.default_rng(11)
    lengths = np.ceil(np.exp(rng.normal(MU, SIGMA, N))).astype(int)  # integer tokens; L > cap iff exp(.) > cap
    pk = partition_keys(N, N)[0]
    write_partition(tmp_path, pk, lognormal_rows(lengths, CAP))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [pk])
        report, meta = materialize_report(instance, tmp_path, CAP)
        advice = report["advice"]
        assert advice["observed_truncation_rate"] == pytest.approx(float(np.mean(lengths > CAP)))
        caps = [c["cap"] for c in advice["candidates"]]
        assert caps[:3] == [500, 600, 800]
        # beyond 2x, the cap doubles only while the previous candidate still predicts > 5% truncation
        for prev, cand in zip(advice["candidates"][2:], advice["candidates"][3:]):
            assert prev["truncation_rate"] > 0.05 and cand["cap"] == 2 * prev["cap"]
        assert advice["candidates"][-1]["truncation_rate"] <= 0.05
        for cand in advice["candidates"]:
            sample_truth = float(np.mean(lengths > cand["cap"]))  # what re-running at that cap would show
            lo, hi = cand["truncation_rate_90ci"]
            assert lo < cand["truncation_rate"] < hi
            assert cand["truncation_rate"] == pytest.approx(sample_truth, abs=max(0.01, 0.2 * sample_truth))
            assert cand["truncation_rate"] == pytest.approx(true_rate(cand["cap"]), abs=max(0.01, 0.2 * sample_truth))
            assert cand["requests"] == int(np.sum(lengths > CAP))
        assert "| 600 |" in meta["cap_advice"].value
        assert meta["prediction_vs_actual"].value == {}  # first report: nothing to compare yet

        # raise the cap 1.5x: the truncated rows are regenerated (censored at the new cap), the rest carried over
        new_cap = 600
        write_partition(tmp_path, pk, lognormal_rows(lengths, new_cap, previous_cap=CAP))
        report2, meta2 = materialize_report(instance, tmp_path, new_cap)
        # the report materialized again at the same cap keeps the comparison (the prediction was made at 400)
        report3, _ = materialize_report(instance, tmp_path, new_cap)
        # lower the cap to 300: rows longer than it are regenerated and cut there
        low_cap = 300
        write_partition(tmp_path, pk, lognormal_rows(lengths, low_cap, previous_cap=new_cap))
        report4, _ = materialize_report(instance, tmp_path, low_cap)
    check = report2["prediction_vs_actual"]
    predicted = next(c for c in advice["candidates"] if c["cap"] == new_cap)
    actual = float(np.mean(lengths > new_cap))
    assert check == {
        "previous_cap": CAP,
        "new_cap": new_cap,
        "predicted_truncation_rate": pytest.approx(predicted["truncation_rate"]),
        "actual_truncation_rate": pytest.approx(actual),
    }
    assert meta2["prediction_vs_actual"].value["actual_truncation_rate"] == pytest.approx(actual)
    assert check["predicted_truncation_rate"] == pytest.approx(actual, abs=max(0.01, 0.2 * actual))
    assert report3["prediction_vs_actual"] == check
    # lowering: more rows are cut, and the prediction (from the 600-token report's fit) says so
    lowered = report4["prediction_vs_actual"]
    actual_low = float(np.mean(lengths > low_cap))
    assert lowered["previous_cap"] == new_cap and lowered["new_cap"] == low_cap
    assert lowered["actual_truncation_rate"] == pytest.approx(actual_low)
    assert lowered["predicted_truncation_rate"] == pytest.approx(actual_low, abs=max(0.01, 0.2 * actual_low))


def censored_loglik(mu: float, sigma: float, lengths: list[float], cap: float) -> float:
    """Log-likelihood of ln L ~ N(mu, sigma^2) for lengths right-censored at ``cap`` (a row at ``cap`` is
    censored): uncensored rows add the density of ln L, censored ones ln P(L > cap). Plain math, no numpy."""
    total = 0.0
    for x in lengths:
        if x >= cap:
            total += math.log(0.5 * math.erfc((math.log(cap) - mu) / (sigma * math.sqrt(2))))
        else:
            z = (math.log(x) - mu) / sigma
            total += -math.log(sigma) - 0.5 * z * z
    return total


def test_cap_advice_keeps_doubling_until_a_cap_fixes_heavy_truncation():
    """75% cut at cap 128: 2x (256) still cuts ~30%, so the advice goes on doubling and offers a cap whose
    predicted truncation is under 10%; that prediction equals observed * S(C) / S(128) under the fitted
    log-normal (recomputed here with math.erfc), the fit maximizes the censored likelihood, and the
    prediction matches what the true distribution gives."""
    from dflash_assets.data.truncation import cap_advice

    cap, sigma, n = 128, 0.6, 2000
    mu = math.log(cap) + 0.6745 * sigma  # P(L > 128) = P(Z > -0.6745) = 0.75
    lengths = np.ceil(np.exp(np.random.default_rng(5).normal(mu, sigma, n))).astype(int)
    frame = pl.DataFrame(
        {
            "completion_tokens": np.minimum(lengths, cap),
            "finish_reason": np.where(lengths > cap, "length", "stop"),
            "max_output_tokens": np.full(n, cap),
        }
    )
    observed = float(np.mean(lengths > cap))
    assert 0.72 < observed < 0.78
    advice = cap_advice(frame, cap, bootstrap=20)
    caps = [c["cap"] for c in advice["candidates"]]
    assert caps[:3] == [160, 192, 256] and caps[3:] == [512 * 2**k for k in range(len(caps) - 3)]
    assert len(caps) <= 6  # short: stops at the first doubling under 5%
    fit_mu, fit_sigma = advice["fit"]["mu"], advice["fit"]["sigma"]
    sample = np.minimum(lengths, cap).astype(float).tolist()
    best = censored_loglik(fit_mu, fit_sigma, sample, cap)
    for d_mu, d_sigma in ((0.01, 0), (-0.01, 0), (0, 0.01), (0, -0.01)):
        assert censored_loglik(fit_mu + d_mu, fit_sigma + d_sigma, sample, cap) < best
    assert fit_mu == pytest.approx(mu, abs=0.05) and fit_sigma == pytest.approx(sigma, abs=0.05)

    def survival(c: float) -> float:
        return 0.5 * math.erfc((math.log(c) - fit_mu) / (fit_sigma * math.sqrt(2)))

    fixed = [c for c in advice["candidates"] if c["truncation_rate"] < 0.10]
    assert fixed, caps
    for cand in advice["candidates"]:
        assert cand["truncation_rate"] == pytest.approx(observed * survival(cand["cap"]) / survival(cap), rel=1e-9)
        truth = 0.5 * math.erfc((math.log(cand["cap"]) - mu) / (sigma * math.sqrt(2)))
        assert cand["truncation_rate"] == pytest.approx(truth, abs=max(0.02, 0.25 * truth))
        assert cand["requests"] == int(np.sum(lengths > cap))
    assert advice["candidates"][-1]["truncation_rate"] <= 0.05 and "note" not in advice

    # a limit below what would fix it: doubling stops at max_cap and the advice says what is still cut
    limited = cap_advice(frame, cap, bootstrap=0, max_cap=300)
    assert [c["cap"] for c in limited["candidates"]] == [160, 192, 256, 300]
    assert limited["note"].startswith("even at 300 tokens about ")


def test_truncation_stats_with_a_row_missing_completion_tokens():
    """A finished row without completion_tokens (server returned no usage) crashed truncation_stats with
    "cannot convert float NaN to integer"; it is now left out of the percentiles and counted as missing."""
    from dflash_assets.data.truncation import truncation_stats

    frame = pl.DataFrame(
        {
            "index": [0, 1, 2, 3],
            "partition": ["p"] * 4,
            "source": ["s"] * 4,
            "error": [None, None, None, "boom"],
            "finish_reason": ["stop", "length", "stop", None],
            "completion_tokens": [10, 32, None, None],
            "truncated_in_reasoning": [False, False, False, None],
            "empty_answer": [False, False, False, None],
        },
        schema_overrides={"error": pl.String, "completion_tokens": pl.Int64},
    )
    stats = truncation_stats(frame)
    assert stats["completion_tokens"] == {
        "p50": 21.0,
        "p90": 29.8,
        "p99": pytest.approx(31.78),
        "max": 32,
        "mean": 21.0,
        "total": 42,
    }
    assert stats["completion_tokens_missing"] == 1
    assert stats["finish_reasons"] == {"length": 1, "stop": 2}
    assert stats["truncation_rate"] == pytest.approx(1 / 3)
