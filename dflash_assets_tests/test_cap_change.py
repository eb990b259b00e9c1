"""A cap change re-runs only what it affects, on the real CPU server (greedy), decided by the
``generation_settings_changed`` sensor.

Scenario (``bench/dflash_simulators/cap_change_scenario.py``, also run by ``bench/bench_cap_change.py``): 3
partitions of 2 prompts at a small cap, so that one partition holds only quick answers (no truncated row) and
the others hold long ones. Raising the cap must re-materialize exactly the partitions with ``length`` rows,
send exactly one request per truncated row (counted by a proxy in front of the server), leave every other row
byte-identical and not re-run ``tokenized_sequences`` of untouched partitions; lowering it must request
exactly the rows longer than the new cap. The runs materialize completions -> tokenized_sequences for each
RunRequest's partition (the sensor's job also holds hidden_states, left out here to stay fast).

Without a server: the sensor's partition-level rule (materialization metadata) agrees with the asset's
row-level rule (``invalid_reason``) on random partitions; a cap that comes back (10 -> 14 -> 10 -> 14)
launches again (fresh run key); a partition with an unfinished run is not requested.
"""

import json
from collections import Counter

import dagster as dg
import pytest

from dflash_assets.app.automation import request_partitions
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.cap_change_scenario import (
    ASSET_KEYS,
    CAP_LOWERED,
    CAP_RAISED,
    CAP_SMALL,
    PROMPTS,
    CapChange,
    Snapshot,
    proxied_inference,
    run_scenario,
)
from dflash_simulators.counting_proxy import CountingProxy


# Partition i holds PROMPTS[2i], PROMPTS[2i+1]. Greedy SmolLM2 answers the first three quick questions
# in ~8 tokens (<|im_end|> included) and runs long on the others.
@pytest.fixture(scope="module")
def scenario(tmp_path_factory, local_server, local_inference):
    root = tmp_path_factory.mktemp("cap_change")
    with CountingProxy(local_server.base_url) as proxy:
        result = run_scenario(
            root, proxy, proxied_inference(local_inference, proxy.base_url), [CAP_SMALL, CAP_RAISED, CAP_LOWERED]
        )
        assert proxy.upstream_errors == 0
    return result


_PROMPT_OF_INDEX = dict(enumerate(PROMPTS))


def before_prompt(row: dict) -> str:
    """The user message a row was generated from (what the proxy counts by)."""
    return _PROMPT_OF_INDEX[row["index"]]


def check_change(
    before: Snapshot,
    change: CapChange,
    touched: dict[str, list[dict]],
    reason: str,
    requested: Counter | None = None,
    probes: int | None = None,
) -> None:
    """Shared assertions for one cap change; ``touched`` = rows (by partition) that must be regenerated
    (``requested``/``probes``: what reached the server, when not one request per touched row and one
    readiness probe per partition run)."""
    after = change.after
    affected = sorted(pk for pk, rows in touched.items() if rows)
    untouched = sorted(set(before.rows) - set(affected))
    assert affected and untouched, "the scenario needs both touched and untouched partitions"
    # the sensor asks for exactly the partitions holding touched rows, with the reason in the tags
    assert sorted(pk for rr in change.run_requests for pk in request_partitions(rr, sorted(before.rows))) == affected
    assert {rr.tags["dflash/reason"] for rr in change.run_requests} == {reason}
    # one request per touched row, for exactly those prompts; one readiness probe per partition run
    expected = Counter(before_prompt(r) for rows in touched.values() for r in rows) if requested is None else requested
    assert change.requested == expected
    assert change.probes == (len(affected) if probes is None else probes)
    for pk in before.rows:
        regenerated = {r["index"] for r in touched[pk]}
        old = {r["index"]: r for r in before.rows[pk]}
        new = {r["index"]: r for r in after.rows[pk]}
        assert new.keys() == old.keys()
        for index, row in new.items():
            if index in regenerated:
                assert row["max_output_tokens"] == change.new_cap and row["completion_tokens"] <= change.new_cap
            else:
                assert row == old[index]  # every column, latency and server included: carried over as is
    for pk in untouched:
        assert after.completions_sha[pk] == before.completions_sha[pk]  # file not rewritten
        assert after.tokenized_sha[pk] == before.tokenized_sha[pk]
        for name in ASSET_KEYS:
            assert after.materializations[name][pk] == before.materializations[name][pk]
    for pk in affected:
        for name in ASSET_KEYS:  # re-materialized once, tokenized downstream included
            assert after.materializations[name][pk] == before.materializations[name][pk] + 1


@pytest.mark.slow
def test_initial_run_has_truncated_and_clean_partitions(scenario):
    assert len(scenario.keys) == 3
    truncated = scenario.initial.truncated()
    assert truncated[scenario.keys[0]] == []  # the quick-answer partition: nothing cut at the small cap
    assert all(truncated[pk] for pk in scenario.keys[1:])
    assert scenario.initial_requests == Counter(PROMPTS)  # one request per prompt
    for rows in scenario.initial.rows.values():
        for r in rows:
            assert r["error"] is None and r["max_output_tokens"] == CAP_SMALL and r["completion_tokens"] <= CAP_SMALL
            assert (r["finish_reason"] == "length") == (r["completion_tokens"] == CAP_SMALL)


@pytest.mark.slow
def test_raising_the_cap_requests_only_truncated_rows(scenario):
    raise_ = scenario.changes[0]
    assert raise_.new_cap == CAP_RAISED
    check_change(scenario.initial, raise_, scenario.initial.truncated(), "cap raised")
    assert sum(raise_.requested.values()) == sum(len(v) for v in scenario.initial.truncated().values())


@pytest.mark.slow
def test_lowering_the_cap_cuts_the_rows_longer_than_it_from_their_own_tokens(scenario, local_server):
    """A request capped at C draws its first C tokens as an uncapped one does, so a row longer than a
    lowered cap is cut to it locally, no request. Greedy decoding makes the check exact: each cut row
    must be what the server itself answers at the lower cap, asked here directly."""
    import httpx

    from dflash_assets.generation.api.replies import parse_chat_completion

    raised, lower = scenario.changes[0].after, scenario.changes[1]
    assert lower.new_cap == CAP_LOWERED
    touched = raised.longer_than(CAP_LOWERED)
    after = {r["index"]: r for rows in lower.after.rows.values() for r in rows}
    cut = {i for rows in touched.values() for i in (r["index"] for r in rows) if after[i]["cut_from_tokens"]}
    assert len(cut) >= 2, "the scenario must cut rows locally"
    not_cut = Counter(before_prompt(r) for rows in touched.values() for r in rows if r["index"] not in cut)
    # untouched partitions and rows as before; the rows that could not be cut were requested, nothing else
    check_change(
        raised,
        lower,
        touched,
        "cap lowered",
        requested=not_cut,
        probes=sum(1 for rows in touched.values() if any(r["index"] not in cut for r in rows)),
    )
    settings = GenerationResource(max_output_tokens=CAP_LOWERED, temperature=0.0).settings()
    for i in sorted(cut):
        row, old = after[i], next(r for rows in touched.values() for r in rows if r["index"] == i)
        assert row["cut_from_tokens"] == old["completion_tokens"] and row["finish_reason"] == "length"
        assert (
            row["completion_tokens"] == row["max_output_tokens"] == CAP_LOWERED and row["latency_s"] == old["latency_s"]
        )
        body = local_server.pool().adapt_body(
            settings.request_body(local_server.model_name, [{"role": "user", "content": PROMPTS[i]}])
        )
        reply = parse_chat_completion(
            httpx.post(f"{local_server.base_url}/chat/completions", json=body, timeout=120).json()
        )
        assert (reply["finish_reason"], reply["completion_tokens"]) == ("length", CAP_LOWERED)
        assert row["content"] == reply["content"] and row["reasoning_content"] is None, (row, reply)


@pytest.mark.slow
def test_sensor_skips_once_everything_matches_the_settings(scenario):
    (result,) = scenario.skip_after
    assert isinstance(result, dg.SkipReason) and f"max_output_tokens={CAP_LOWERED}" in result.skip_message


# ---------------------------------------------------------------- sensor decisions without a server


def _result(index: int, finish_reason: str | None, completion_tokens: int | None, error: str | None = None):
    from dflash_assets.generation.client.results import CompletionResult

    text = None if error else "some answer"
    return CompletionResult(
        index,
        None,
        text,
        None if error else finish_reason,
        None if error else 12,
        None if error else completion_tokens,
        None,
        0.5,
        "http://s0/v1",
        1,
        error,
    )


def _random_partition(rng, settings_choices) -> list[dict]:
    """Rows as the completions asset makes them: stop / length at the cap they were made with / abort / error."""
    from dflash_assets.generation.rows.records import row_from_result

    rows = []
    for index in range(rng.randint(1, 5)):
        made_with = rng.choice(settings_choices)
        cap = made_with.max_output_tokens
        kind = rng.choice(["stop", "stop", "length", "length", "abort", "error"])
        if kind == "stop":
            result = _result(index, "stop", rng.randint(1, cap))
        elif kind == "length":
            result = _result(index, "length", cap)
        elif kind == "abort":
            result = _result(index, "abort", rng.randint(1, cap))
        else:
            result = _result(index, None, None, error="HTTP 503 after 5 attempts")
        rows.append(row_from_result(result, {"index": index, "prompt_id": f"p{index}", "source": "s"}, made_with))
    return rows


def test_partition_decision_matches_row_decision():
    """The sensor's partition-level rule (from materialization metadata) touches a partition exactly when
    the asset's row-level rule would regenerate one of its rows: no partition launched for nothing, none
    missed. 400 random partitions against caps below, at and above the caps rows were made with."""
    import random

    from dflash_assets.app.automation import affected_reason
    from dflash_assets.common.settings import GenerationSettings
    from dflash_assets.generation.rows.records import invalid_reason, rows_to_frame
    from dflash_assets.stages.completions.tables import completion_stats

    rng = random.Random(7)
    made = [GenerationSettings(max_output_tokens=c, temperature=0.0) for c in (8, 12, 16)]
    made.append(GenerationSettings(max_output_tokens=12, temperature=0.6))  # other sampling
    mismatches = []
    for _ in range(400):
        rows = _random_partition(rng, made)
        meta = json.loads(json.dumps(completion_stats(rows_to_frame(rows))))  # as metadata round-trips (JSON)
        for cap in (6, 8, 10, 12, 14, 16, 20):
            settings = GenerationSettings(max_output_tokens=cap, temperature=0.0)
            row_reasons = [invalid_reason(r, settings) for r in rows]
            if (affected_reason(meta, settings) is not None) != any(row_reasons):
                mismatches.append(
                    (
                        cap,
                        [(r["finish_reason"], r["completion_tokens"], r["max_output_tokens"]) for r in rows],
                        affected_reason(meta, settings),
                        row_reasons,
                    )
                )
    assert not mismatches, mismatches[:3]


def test_sensor_relaunches_a_partition_when_a_cap_comes_back():
    """Cap 10 -> 14 -> 10 -> 14: the second raise must launch again. Dagster creates one run per sensor
    ``run_key`` for the sensor's whole life (RunRequest docstring), so a key made only of (partition, cap,
    sampling) would be skipped by the daemon the second time. A partition with a run not yet finished
    is not requested."""
    from dflash_assets.definitions import defs
    from dflash_assets.orchestration.partitions import prompt_ranges

    sensor = defs.get_sensor_def("generation_settings_changed")
    pk = "0000000-0000001"

    def materialized(cap: int, length_rows: bool) -> None:
        from dflash_assets.common.settings import GenerationSettings

        fp = GenerationSettings(max_output_tokens=cap, temperature=0.0).sampling_fingerprint()
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                "completions",
                partition=pk,
                metadata={
                    "errors": 0,
                    "finish_reasons": {"stop": 1, "length": 1} if length_rows else {"stop": 2},
                    "settings_fingerprints": [fp],
                    "completion_tokens_max": cap,
                    "length_row_caps": [cap] if length_rows else [],
                },
            )
        )

    def tick(cap: int) -> list[dg.RunRequest]:
        generation = GenerationResource(max_output_tokens=cap, temperature=0.0)
        result = sensor(
            dg.build_sensor_context(
                instance=instance, resources={"generation": generation, "target_model": TargetModelResource()}
            )
        )
        return [] if isinstance(result, dg.SkipReason) else list(result)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [pk])
        materialized(10, length_rows=True)
        first = tick(14)
        assert [request_partitions(r, [pk]) for r in first] == [[pk]]
        materialized(14, length_rows=True)  # the raise ran; still cut at 14
        lowered = tick(10)
        assert [r.tags["dflash/reason"] for r in lowered] == ["cap lowered"]
        materialized(10, length_rows=True)  # back at 10
        second = tick(14)
        assert [request_partitions(r, [pk]) for r in second] == [[pk]]
        assert len({first[0].run_key, lowered[0].run_key, second[0].run_key}) == 3
        assert tick(14) and tick(14)[0].run_key == second[0].run_key  # same state: same key (no duplicate runs)

        # a run for the partition already exists (planned materialization, not finished): not requested again
        @dg.asset(name="completions", partitions_def=prompt_ranges)
        def stand_in() -> None: ...

        job = dg.Definitions(assets=[stand_in], jobs=[dg.define_asset_job("j", selection=[stand_in])]).resolve_job_def(
            "j"
        )
        instance.create_run_for_job(job, tags={"dagster/partition": pk})
        assert tick(14) == []
