"""The README stays a README for users (short, no run logs, links that resolve) and docs/configuration.md
names every config key the resources and assets accept, with the default the code declares (once)."""

import inspect
import re
from pathlib import Path

import pytest

from dflash_assets.dflash.training.config import TrainConfig, TrainSettings
from dflash_assets.stages.completions.config import CompletionsConfig
from dflash_assets.stages.drafter.config import DrafterConfig
from dflash_assets.stages.evaluation.config import EvaluationConfig
from dflash_assets.stages.hidden_states import HiddenStatesConfig
from dflash_assets.stages.prompts import PromptCorpusConfig
from dflash_assets.stages.resources.cost import CostResource
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.inference_sections import (
    ClientSettings,
    ExternalSettings,
    LocalSettings,
    SGLangSettings,
    VLLMSettings,
)
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import TokenizeConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_has_no_run_log():
    assert len(README.splitlines()) < 180
    assert not re.search(r"\b\d{1,2}:\d{2} UTC\b", README), "UTC times belong in bench/RESULTS.md"
    assert not re.search(r"`[0-9a-f]{7,40}`", README), "commit hashes belong in bench/RESULTS.md"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "dated measurements belong in bench/RESULTS.md"


def test_readme_says_once_what_ran_on_a_serving_engine():
    assert README.count("nothing on a real SGLang") == 1
    # issue 52: the H200's gpu_check row stood beside "nothing on a GPU"
    assert "nothing on a GPU" not in README and "On a GPU: `bench/gpu_check` on one H200" in README
    assert "bench/dflash_simulators/sglang_stub.py" in README


def test_readme_keeps_the_section_other_changes_merge_into():
    assert "\n## What invalidates what\n" in README


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


SECTIONS = [
    ("resources.storage", StorageResource),
    ("resources.inference", InferenceServerResource),
    ("resources.inference.local", LocalSettings),
    ("resources.inference.sglang", SGLangSettings),
    ("resources.inference.vllm", VLLMSettings),
    ("resources.inference.external", ExternalSettings),
    ("resources.inference.client", ClientSettings),
    ("resources.generation", GenerationResource),
    ("resources.target_model", TargetModelResource),
    ("resources.cost", CostResource),
    ("ops.prompt_corpus.config", PromptCorpusConfig),
    ("ops.completions.config", CompletionsConfig),
    ("ops.tokenized_sequences.config", TokenizeConfig),
    ("ops.hidden_states.config", HiddenStatesConfig),
    ("ops.dflash_drafter.config", DrafterConfig),
    ("ops.drafter_evaluation.config", EvaluationConfig),
]


def _section(section: str) -> str:
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index(f"## `{section}`")
    ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
    return text[start : min(ends, default=len(text))]


@pytest.mark.parametrize("section, cls", SECTIONS)
def test_configuration_reference_names_every_key(section, cls):
    body = _section(section)
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", body, re.MULTILINE))
    documented |= {
        k
        for row in re.findall(r"^\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)+) \|", body, re.MULTILINE)
        for k in re.findall(r"`([a-z_0-9]+)`", row)
    }
    assert documented == set(cls.model_fields), f"docs/configuration.md, {section}: add or remove keys"


@pytest.mark.parametrize("section, cls", SECTIONS)
def test_configuration_reference_states_each_numeric_default_as_declared(section, cls):
    """A default written as a number in the table is the field's default."""
    wrong = {}
    for key, cell in re.findall(r"^\| `([a-z_0-9]+)` \| ([^|]+) \|", _section(section), re.MULTILINE):
        field = cls.model_fields.get(key)
        number = cell.strip().replace(",", "")
        if field is None or not re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", number):
            continue
        if isinstance(field.default, bool) or float(number) != float(field.default):
            wrong[key] = (cell.strip(), field.default)
    assert not wrong, f"docs/configuration.md, {section}: documented vs declared default: {wrong}"


def test_training_settings_are_declared_once():
    """The asset's config and the library's run config (what torchrun's worker reads) take every training
    setting from TrainSettings: neither declares one again, so each has one default."""
    shared = set(TrainSettings.model_fields)
    for cls in (DrafterConfig, TrainConfig):
        assert not shared & set(inspect.get_annotations(cls)), f"{cls.__name__} redeclares a setting"
    asset = DrafterConfig().model_dump(include=shared)
    library = TrainConfig(shards=[], out_dir="run").model_dump(include=shared)
    assert asset == library == TrainSettings().model_dump()
