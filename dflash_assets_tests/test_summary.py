"""The end-of-run summary: its numbers equal the assets' metadata (summed over the LATEST materialization
of each partition), it says where every output is, and it tells how to open the UI on the same instance.

Materializations are reported runless into a test instance with the metadata keys the assets emit
(see dflash_assets/assets/*.py); the printed text is parsed back and compared to those values."""

import re
from pathlib import Path

import dagster as dg
import pytest

from dflash_assets.app.summary import collect_summary
from dflash_assets.app.summary_lines import format_summary
from dflash_assets.orchestration.check_gate import BLOCKING_CHECKS
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets_tests.checked_events import report_checked

KEYS = ["0000000-0000003", "0000004-0000007"]
README = Path(__file__).resolve().parent.parent / "README.md"

CORPUS_META = {
    "num_prompts": 8,
    "rows_per_source": {"alpaca": 5, "sharegpt": 3},
    "duplicates": 2,
    "duplicates_per_source": {"alpaca": 2},
    "rejected": 3,
    "rejected_by_reason": {"invalid JSON": 2, "unknown shape": 1},
    "num_partitions": 2,
    "partition_size": 4,
    "files": ["a.jsonl", "b.json"],
    "seconds": 0.12,
    "config_fingerprint": "f" * 16,
}
# completions[pk] as first made (a stale version) and as made again; only the second may be counted
COMPLETIONS_STALE = {
    KEYS[0]: {
        "rows": 4,
        "finish_reasons": {"length": 4},
        "errors": 0,
        "completion_tokens_total": 512,
        "output_ids_missing": 4,
    },
}
COMPLETIONS = {
    KEYS[0]: {
        "rows": 4,
        "finish_reasons": {"length": 1, "stop": 2},
        "errors": 1,
        "truncated_in_reasoning": 0,
        "empty_answer": 0,
        "completion_tokens_total": 301,
        "completion_tokens_missing": 0,
        "length_row_caps": [128],
        "settings_fingerprints": ["abc"],
        "completion_tokens_max": 128,
        "output_ids_missing": 1,
        "requested": 4,
        "carried_over": 0,
        "max_output_tokens": 128,
    },
    KEYS[1]: {
        "rows": 4,
        "finish_reasons": {"abort": 1, "length": 2, "stop": 1},
        "errors": 0,
        "truncated_in_reasoning": 1,
        "empty_answer": 1,
        "completion_tokens_total": 420,
        "completion_tokens_missing": 0,
        "length_row_caps": [128],
        "settings_fingerprints": ["abc"],
        "completion_tokens_max": 128,
        "output_ids_missing": 2,
        "requested": 4,
        "carried_over": 0,
        "max_output_tokens": 128,
    },
}
TOKENIZED_STALE = {KEYS[1]: {"rows": 1, "loss_tokens": 5, "total_tokens": 50}}
TOKENIZED = {
    KEYS[0]: {
        "rows": 3,
        "counts": {"kept": 3},
        "loss_tokens": 173,
        "total_tokens": 410,
        "num_loss_tokens_min": 40,
        "num_loss_tokens_median": 61.0,
        "end_token": "<|im_end|>",
    },
    KEYS[1]: {
        "rows": 2,
        "counts": {"kept": 2, "dropped_length": 2},
        "loss_tokens": 97,
        "total_tokens": 260,
        "num_loss_tokens_min": 30,
        "num_loss_tokens_median": 48.5,
        "end_token": "<|im_end|>",
    },
}
HIDDEN_STALE = {KEYS[0]: {"rows": 3, "tokens": 100, "bytes": 5_760_000}}
HIDDEN = {
    KEYS[0]: {
        "rows": 3,
        "tokens": 410,
        "bytes": 2_361_600 + 7_432,
        "bytes_per_token": 5778.1,
        "bytes_per_token_expected": 5760,
        "estimated_corpus_bytes": 10_000_000,
        "target_layer_ids": [1, 8, 15, 22, 29],
        "shards": 1,
        "shards_written": 1,
        "shards_kept": 0,
        "tokens_per_s": 800.0,
        "wall_s": 0.5,
    },
    KEYS[1]: {
        "rows": 2,
        "tokens": 260,
        "bytes": 1_497_600 + 5_120,
        "bytes_per_token": 5779.7,
        "bytes_per_token_expected": 5760,
        "estimated_corpus_bytes": 10_000_000,
        "target_layer_ids": [1, 8, 15, 22, 29],
        "shards": 1,
        "shards_written": 1,
        "shards_kept": 0,
        "tokens_per_s": 790.0,
        "wall_s": 0.3,
    },
}
CAP_ADVICE_MD = (
    "Method: log-normal MLE on right-censored lengths.\n\n"
    "| cap | predicted truncation | 90% interval | requests | tokens to generate | extra tokens |\n"
    "|---|---|---|---|---|---|\n"
    # the en dash is the one the cap-advice table writes between an interval's ends
    "| 160 | 33.10% | 28.00%–38.00% | 3 | 520 | 136 |\n"  # noqa: RUF001
    "| 256 | 9.50% | 7.00%–12.00% | 3 | 610 | 226 |\n"  # noqa: RUF001
    "| 512 | 0.80% | 0.40%–1.50% | 3 | 640 | 256 |"  # noqa: RUF001
)
TRUNCATION = {
    "cap": 128,
    "rows": 8,
    "finish_reasons": {"abort": 1, "length": 3, "stop": 3},
    "truncation_rate": 0.4286,
    "truncation_rate_per_source": {"alpaca": 0.5, "sharegpt": 0.3333},
    "rows_per_turn_kind": {"single-turn prompt": 5, "tool-call turn": 2},
    "truncation_rate_per_turn_kind": {"single-turn prompt": 0.4, "tool-call turn": 0.5},
    "partitions_missing": 0,
    "truncated_in_reasoning": 1,
    "empty_answer": 1,
    "cap_advice": dg.MetadataValue.md(CAP_ADVICE_MD),
}
DRAFTER = {
    "parameters": 10_627_200,
    "train_rows": 4,
    "train_tokens": 245,
    "steps": 30,
    "final_loss": 4.51,
    "tokens_per_s": 610.2,
    "world_size": 1,
    "heldout_loss": 5.02,
    "heldout_rows": 1,
    "partitions_used": 2,
    "seed": 0,
    "eval_fraction": 0.2,
    "max_length": 3072,
    "block_size": 16,
    "mask_token_id": 49151,
    "target_layer_ids": [1, 8, 15, 22, 29],
    "wall_s": 20.1,
    "outcome": "trained",
    "outcome_text": "trained 30 steps on 245 tokens",
}
EVALUATION = {
    "tau": 1.4375,
    "tau_untrained": 1.0312,
    "tau_stderr": 0.05,
    "tau_untrained_stderr": 0.01,
    "tau_margin_in_stderr": 7.9,
    "teacher_forced_tau": 1.52,
    "teacher_forced_tau_untrained": 1.0,
    "target_forwards_plain": 64,
    "target_forwards_spec": 45,
    "target_forwards_saved": 19,
    "speedup_wall": 1.1,
    "lossless": True,
    "num_prompts": 1,
    "new_tokens": 64,
    "block_size": 16,
    "tau_pooled": 1.4211,
    "tau_pooled_stderr": 0.04,
    "outcome": "evaluated",
    "tau_by_dataset": {
        "heldout": {
            "prompts": 1,
            "tau": 1.4375,
            "tau_stderr": 0.05,
            "tau_pooled": 1.4211,
            "tau_pooled_stderr": 0.04,
            "tau_untrained": 1.0312,
            "speedup_wall": 1.1,
        },
        "humaneval": {
            "prompts": 3,
            "tau": 1.61,
            "tau_stderr": 0.2,
            "tau_pooled": 1.55,
            "tau_pooled_stderr": 0.1,
            "tau_untrained": 1.0,
            "speedup_wall": 1.2,
        },
    },
}


def report(instance, key: str, metadata: dict, partition: str | None = None) -> None:
    report_checked(instance, key, partition, metadata)  # with its blocking checks passed, as a real run leaves it


def fill(instance, root: Path) -> None:
    """Materializations of every asset the summary reads, in pipeline order, with partitions re-made
    after later ones (so 'latest overall' and 'latest per partition' differ)."""
    instance.add_dynamic_partitions(prompt_ranges.name, KEYS)
    report(instance, "prompt_corpus", {**CORPUS_META, "num_prompts": 99}, None)  # an older corpus
    report(
        instance,
        "prompt_corpus",
        {**CORPUS_META, "path": dg.MetadataValue.path(str(root / "prompt_corpus" / "corpus.parquet"))},
    )
    for stale, latest, key, sub in (
        (COMPLETIONS_STALE, COMPLETIONS, "completions", "completions"),
        (TOKENIZED_STALE, TOKENIZED, "tokenized_sequences", "tokenized_sequences"),
        (HIDDEN_STALE, HIDDEN, "hidden_states", "hidden_states"),
    ):
        for pk, meta in stale.items():
            report(instance, key, meta, pk)
        for pk in KEYS:
            report(instance, key, {**latest[pk], "path": dg.MetadataValue.path(str(root / sub / pk))}, pk)
    report(
        instance, "truncation_report", {**TRUNCATION, "truncation_rate": 0.9, "cap": 64}
    )  # before the cap was raised
    report(instance, "truncation_report", TRUNCATION)
    report(
        instance,
        "dflash_drafter",
        {**DRAFTER, "export_path": dg.MetadataValue.path(str(root / "dflash_drafter" / "export"))},
    )
    report(instance, "drafter_evaluation", EVALUATION)


def line(text: str, label: str) -> str:
    """The text after ``label`` on the numbers line that starts with it (exactly one such line)."""
    numbers = text.split("== where the outputs are ==")[0]
    found = [ln[len(label) :].strip() for ln in numbers.splitlines() if ln.startswith(label)]
    assert len(found) == 1, (label, text)
    return found[0]


def ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def test_summary_numbers_equal_the_latest_metadata_per_partition(tmp_path):
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        fill(instance, root)
        s = collect_summary(instance, KEYS, StorageResource(root=str(root)))
        # a command that materialized neither the drafter nor the evaluation reports them as reused
        again = format_summary(collect_summary(instance, KEYS, StorageResource(root=str(root)), ran=[]))
    text = format_summary(s)
    assert line(again, "drafter  ") == (
        f"{DRAFTER['parameters']} parameters; reused because nothing changed "
        "(30 steps on 245 tokens, no training step this run)"
    )
    assert line(again, "acceptance length").endswith("(reused: drafter unchanged, no decoding)")

    # expected numbers from the metadata above, summed over the latest version of each partition
    completions = sum(COMPLETIONS[pk]["rows"] for pk in KEYS)
    errors = sum(COMPLETIONS[pk]["errors"] for pk in KEYS)
    without_ids = sum(COMPLETIONS[pk]["output_ids_missing"] for pk in KEYS)
    finish: dict[str, int] = {}
    for pk in KEYS:
        for reason, n in COMPLETIONS[pk]["finish_reasons"].items():
            finish[reason] = finish.get(reason, 0) + n
    tok_rows = sum(TOKENIZED[pk]["rows"] for pk in KEYS)
    loss_tokens = sum(TOKENIZED[pk]["loss_tokens"] for pk in KEYS)
    hs_bytes = sum(HIDDEN[pk]["bytes"] for pk in KEYS)
    hs_tokens = sum(HIDDEN[pk]["tokens"] for pk in KEYS)
    # counting a stale version too (or instead) would give other sums: the check below can fail
    assert COMPLETIONS_STALE[KEYS[0]]["finish_reasons"] != COMPLETIONS[KEYS[0]]["finish_reasons"]
    assert TOKENIZED_STALE[KEYS[1]]["loss_tokens"] != TOKENIZED[KEYS[1]]["loss_tokens"]
    assert HIDDEN_STALE[KEYS[0]]["bytes"] != HIDDEN[KEYS[0]]["bytes"]

    # the dict
    assert (s["prompts"], s["duplicates"], s["rejected"], s["partitions"]) == (8, 2, 3, 2)
    assert (s["completions"], s["completion_errors"], s["finish_reasons"]) == (completions, errors, finish)
    assert s["completions_without_ids"] == without_ids == 3
    assert (s["tokenized_rows"], s["loss_tokens"]) == (tok_rows, loss_tokens)
    assert (s["hidden_state_bytes"], s["hidden_state_tokens"]) == (hs_bytes, hs_tokens)
    assert (s["truncation_rate"], s["cap"], s["cap_advice"]) == (0.4286, 128, CAP_ADVICE_MD)
    assert (s["drafter_parameters"], s["drafter_train_tokens"]) == (DRAFTER["parameters"], DRAFTER["train_tokens"])
    assert (s["tau"], s["tau_untrained"]) == (EVALUATION["tau"], EVALUATION["tau_untrained"])

    # the text, parsed back
    assert ints(line(text, "prompts")) == [
        CORPUS_META["num_prompts"],
        CORPUS_META["duplicates"],
        CORPUS_META["rejected"],
        len(KEYS),
    ]
    comp = line(text, "completions")
    assert ints(comp.split(";")[0]) == [completions, errors, without_ids]
    assert comp.split(";")[0].endswith(f"{without_ids} without the model's own token ids")
    printed_finish = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", comp.split("finish_reason:")[1])}
    assert printed_finish == finish and sum(finish.values()) == completions - errors
    trunc = line(text, "truncation")
    rate, cap = re.fullmatch(r"([\d.]+)% of completions hit the cap of (\d+) tokens", trunc).groups()
    assert float(rate) / 100 == pytest.approx(TRUNCATION["truncation_rate"], abs=5e-5) and int(cap) == TRUNCATION["cap"]
    assert line(text, "turn kinds") == "single-turn prompt 5 (40% cut), tool-call turn 2 (50% cut)"
    assert ints(line(text, "tokenized")) == [tok_rows, loss_tokens]
    hs = line(text, "hidden states      ")
    assert re.fullmatch(rf"{hs_bytes} bytes \({hs_bytes / 1e6:.1f} MB\) for {hs_tokens} tokens", hs), hs
    assert line(text, "drafter  ") == f"{DRAFTER['parameters']} parameters; trained 30 steps on 245 tokens"
    acc = re.fullmatch(
        r"tau ([\d.]+) \+- ([\d.]+) \(mean of per-prompt means; pooled ([\d.]+) \+- ([\d.]+)\) "
        r"\(untrained drafter: ([\d.]+) \+- ([\d.]+)\) on (\d+) held-out prompts, speedup ([\d.]+)x, "
        r"lossless: (yes|NO)",
        line(text, "acceptance length"),
    )
    assert acc, line(text, "acceptance length")
    assert [float(x) for x in acc.groups()[:6]] == [
        EVALUATION[k]
        for k in ("tau", "tau_stderr", "tau_pooled", "tau_pooled_stderr", "tau_untrained", "tau_untrained_stderr")
    ]
    assert "humaneval: tau 1.61 +- 0.2 (pooled 1.55 +- 0.1; untrained 1.0) on 3 prompts" in text
    assert int(acc.group(7)) == EVALUATION["num_prompts"] and (acc.group(9) == "yes") == EVALUATION["lossless"]
    assert float(acc.group(8)) == EVALUATION["speedup_wall"]

    # cap advice: the Markdown table's rows as aligned text, every cell kept, separator row dropped
    advice_lines = [
        ln
        for ln in text.splitlines()[
            text.splitlines().index(next(ln for ln in text.splitlines() if ln.startswith("cap advice"))) :
        ][:4]
    ]
    md_rows = [[c.strip() for c in r.strip("|").split("|")] for r in CAP_ADVICE_MD.splitlines() if r.startswith("| ")]
    assert len(md_rows) == 4
    for printed, cells in zip(advice_lines, md_rows):
        assert re.split(r"\s{2,}", printed.removeprefix("cap advice").strip()) == cells
    assert "|---" not in text


def test_summary_says_where_every_output_is_and_how_to_open_the_ui(tmp_path):
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        fill(instance, root)
        text = format_summary(collect_summary(instance, KEYS, StorageResource(root=str(root))))
        home = instance.root_directory
    where = text.split("== where the outputs are ==")[1]
    expected = {  # label -> path under the storage root (the layout the assets write)
        "prompt corpus": "prompt_corpus/corpus.parquet",
        "rows set aside": ["prompt_corpus/rejected.parquet", "tokenized_sequences/<pk>.set_aside.parquet"],
        "completions": "completions/<pk>.parquet",
        "server logs": "server_logs/<pk>/",
        "truncation report": "truncation_report/report.json",
        "length plot": "truncation_report/completion_lengths.png",
        "tokenized": "tokenized_sequences/<pk>.parquet",
        "hidden states": "hidden_states/<pk>/",
        "drafter export": "dflash_drafter/export/",
        "loss curve": "dflash_drafter/loss_curve.png",
        "training runs": "dflash_drafter/runs/",
        "evaluation": "drafter_evaluation/report.json",
        "acceptance plot": "drafter_evaluation/acceptance.png",
    }
    rows = [re.match(r"\s*(\S.*?)\s{2,}(\S+)", ln).groups() for ln in where.strip().splitlines()]
    got: dict[str, list[str]] = {}
    for label, location in rows:
        got.setdefault(label, []).append(location)
    for label, rel in expected.items():
        assert got.pop(label) == [
            str(root / r) if not r.endswith("/") else f"{root / r}/" for r in ([rel] if isinstance(rel, str) else rel)
        ]
    assert got.pop("<pk>") == ["one"] and f"2 partition keys: {KEYS[0]} .. {KEYS[1]}" in where
    ui = got.pop("open the UI")
    assert got == {}
    assert "not written yet" not in where
    # the README's UI command, on this instance
    assert ui == [f"DAGSTER_HOME={home}"]
    assert re.search(rf"DAGSTER_HOME={re.escape(home)} \S*dagster dev -h 127\.0\.0\.1 -p 3000", where)
    assert "dagster dev -h 127.0.0.1 -p 3000" in README.read_text()
    # every output the summary names is in the README's table of outputs
    readme = README.read_text()
    for rel in [r for v in expected.values() for r in ([v] if isinstance(v, str) else v)]:
        assert f"`{rel.rstrip('/')}" in readme, rel


def test_one_partition_is_named_and_missing_stages_are_marked(tmp_path):
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, KEYS[:1])
        report(instance, "prompt_corpus", CORPUS_META)
        report(instance, "completions", COMPLETIONS[KEYS[0]], KEYS[0])
        s = collect_summary(instance, KEYS[:1], StorageResource(root=str(root)))
    text = format_summary(s)
    assert line(text, "completions        ").startswith(f"{COMPLETIONS[KEYS[0]]['rows']} rows (errors: 1)")
    assert line(text, "truncation") == "- of completions hit the cap of - tokens"
    assert line(text, "tokenized          ") == "0 rows, 0 loss tokens"
    assert line(text, "acceptance length") == "tau -"
    assert "cap advice" not in text and "<pk>" not in text
    where = text.split("== where the outputs are ==")[1]
    assert f"{root}/completions/{KEYS[0]}.parquet\n" in where  # written: no mark
    assert f"{root}/tokenized_sequences/{KEYS[0]}.parquet  (not written yet)" in where
    assert f"{root}/drafter_evaluation/acceptance.png  (not written yet)" in where


def test_an_evaluation_without_the_untrained_drafter_prints_no_untrained_figure(tmp_path):
    """The default evaluation (``untrained_baseline: false``) reports no ``*_untrained`` figure: the summary
    leaves the untrained drafter out of the acceptance and dataset lines instead of printing ``None``."""
    untrained_keys = ("tau_untrained", "tau_untrained_stderr", "tau_margin_in_stderr", "teacher_forced_tau_untrained")
    evaluation = {k: v for k, v in EVALUATION.items() if k not in untrained_keys}
    evaluation["tau_by_dataset"] = {
        name: {k: v for k, v in d.items() if k != "tau_untrained"} for name, d in EVALUATION["tau_by_dataset"].items()
    }
    with dg.instance_for_test() as instance:
        fill(instance, tmp_path / "data")
        report(instance, "drafter_evaluation", evaluation)
        s = collect_summary(instance, KEYS, StorageResource(root=str(tmp_path / "data")))
    text = format_summary(s)
    assert s["tau_untrained"] is None
    assert line(text, "acceptance length") == (
        f"tau {EVALUATION['tau']} +- {EVALUATION['tau_stderr']} (mean of per-prompt means; pooled "
        f"{EVALUATION['tau_pooled']} +- {EVALUATION['tau_pooled_stderr']}) on {EVALUATION['num_prompts']} held-out "
        f"prompts, speedup {EVALUATION['speedup_wall']}x, lossless: yes"
    )
    assert "  humaneval: tau 1.61 +- 0.2 (pooled 1.55 +- 0.1) on 3 prompts\n" in text
    assert "untrained" not in text and "None" not in text.split("== where the outputs are ==")[0]


OUTCOMES: dict[tuple[str, str], bool] = {}  # (check name, partition) -> passed, read by the stand-in asset below


def stand_in_tokenized(keys: list[str]):
    """An asset with the project's key and two of its check names (one WARN, one ERROR), whose outcomes
    the test sets per partition, and its other blocking checks, passing: real runs write real check evaluations
    into the instance."""
    warn, err = "retokenized_length_matches_server", "no_empty_loss_mask"
    others = [n for n in BLOCKING_CHECKS["tokenized_sequences"] if n != err]  # evaluated, passing

    @dg.asset(
        name="tokenized_sequences",
        partitions_def=dg.StaticPartitionsDefinition(keys),
        check_specs=[
            dg.AssetCheckSpec(warn, asset="tokenized_sequences"),
            dg.AssetCheckSpec(err, asset="tokenized_sequences"),
            *[dg.AssetCheckSpec(n, asset="tokenized_sequences") for n in others],
        ],
    )
    def asset(context):
        pk = context.partition_key
        yield dg.MaterializeResult()
        yield dg.AssetCheckResult(
            check_name=warn,
            passed=OUTCOMES.get((warn, pk), True),
            severity=dg.AssetCheckSeverity.WARN,
            description="lengths differ",
        )
        yield dg.AssetCheckResult(
            check_name=err, passed=OUTCOMES.get((err, pk), True), severity=dg.AssetCheckSeverity.ERROR
        )
        for name in others:
            yield dg.AssetCheckResult(check_name=name, passed=True)

    return asset


def test_failed_checks_of_any_severity_appear_in_the_summary_with_counts_and_partitions(tmp_path):
    """Issue 16: `retokenized_length_matches_server` failed (WARN) in 3 of 4 partitions and only Dagster's
    DEBUG lines said so. The summary reads the latest evaluation per partition from the instance."""
    root = tmp_path / "data"
    keys = ["0000000-0000003", "0000004-0000007", "0000008-0000011", "0000012-0000015"]
    asset = stand_in_tokenized(keys)
    OUTCOMES.clear()
    OUTCOMES.update({("retokenized_length_matches_server", pk): pk == keys[1] for pk in keys})
    OUTCOMES[("no_empty_loss_mask", keys[3])] = False
    with dg.instance_for_test() as instance:
        fill(instance, root)
        for pk in keys:
            dg.materialize([asset], instance=instance, partition_key=pk, raise_on_error=False)
        # a partition that failed earlier and passes now: only its latest evaluation counts
        OUTCOMES[("retokenized_length_matches_server", keys[2])] = True
        dg.materialize([asset], instance=instance, partition_key=keys[2])
        s = collect_summary(instance, keys, StorageResource(root=str(root)))
    by_name = {c["check"]: c for c in s["failed_checks"]}
    assert set(by_name) == {
        "tokenized_sequences.retokenized_length_matches_server",
        "tokenized_sequences.no_empty_loss_mask",
    }
    warn = by_name["tokenized_sequences.retokenized_length_matches_server"]
    assert (warn["severity"], warn["failed"], warn["evaluated"], warn["partitions"]) == (
        "WARN",
        2,
        4,
        [keys[0], keys[3]],
    )
    err = by_name["tokenized_sequences.no_empty_loss_mask"]
    assert (err["severity"], err["failed"], err["partitions"]) == ("ERROR", 1, [keys[3]])
    text = format_summary(s)
    numbers = text.split("== where the outputs are ==")[0]
    assert (
        f"tokenized_sequences.retokenized_length_matches_server (WARN): 2 of 4 partitions failed: {keys[0]}, "
        f"{keys[3]}; lengths differ"
    ) in numbers
    assert f"tokenized_sequences.no_empty_loss_mask (ERROR): 1 of 4 partitions failed: {keys[3]}" in numbers


def test_summary_says_no_failed_checks_when_all_pass(tmp_path):
    OUTCOMES.clear()
    with dg.instance_for_test() as instance:
        fill(instance, tmp_path / "data")
        dg.materialize([stand_in_tokenized(KEYS)], instance=instance, partition_key=KEYS[0])
        s = collect_summary(instance, KEYS, StorageResource(root=str(tmp_path / "data")))
    assert s["failed_checks"] == []
    assert "failed checks      none" in format_summary(s)
