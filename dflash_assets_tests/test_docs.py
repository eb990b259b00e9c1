"""The README stays a README for users (short, no run logs, links that resolve) and docs/configuration.md
names every config key the resources and assets accept."""

import re
from pathlib import Path

import pytest

from dflash_assets.assets.drafter import DrafterConfig
from dflash_assets.assets.evaluation import EvaluationConfig
from dflash_assets.assets.hidden_states import HiddenStatesConfig
from dflash_assets.assets.prompts import PromptCorpusConfig
from dflash_assets.assets.tokenized import TokenizeConfig
from dflash_assets.resources.cost import CostResource
from dflash_assets.resources.generation import GenerationResource
from dflash_assets.resources.inference import InferenceServerResource
from dflash_assets.resources.inference_sections import (
    ClientSettings,
    ExternalSettings,
    LocalSettings,
    SGLangSettings,
    VLLMSettings,
)
from dflash_assets.resources.storage import StorageResource
from dflash_assets.resources.target_model import TargetModelResource

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_has_no_run_log():
    assert len(README.splitlines()) < 180
    assert not re.search(r"\b\d{1,2}:\d{2} UTC\b", README), "UTC times belong in bench/RESULTS.md"
    assert not re.search(r"`[0-9a-f]{7,40}`", README), "commit hashes belong in bench/RESULTS.md"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README), "dated measurements belong in bench/RESULTS.md"


def test_readme_says_once_what_ran_on_a_serving_engine():
    assert README.count("nothing on a real SGLang") == 1
    assert "dflash_assets/simulation/sglang_stub.py" in README


def test_readme_keeps_the_section_other_changes_merge_into():
    assert "\n## What invalidates what\n" in README


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


@pytest.mark.parametrize(
    "section, cls",
    [
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
        ("ops.tokenized_sequences.config", TokenizeConfig),
        ("ops.hidden_states.config", HiddenStatesConfig),
        ("ops.dflash_drafter.config", DrafterConfig),
        ("ops.drafter_evaluation.config", EvaluationConfig),
    ],
)
def test_configuration_reference_names_every_key(section, cls):
    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index(f"## `{section}`")
    ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
    body = text[start : min(ends, default=len(text))]
    documented = set(re.findall(r"^\| `([a-z_0-9]+)`", body, re.MULTILINE))
    documented |= {
        k
        for row in re.findall(r"^\| (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)+) \|", body, re.MULTILINE)
        for k in re.findall(r"`([a-z_0-9]+)`", row)
    }
    assert documented == set(cls.model_fields), f"docs/configuration.md, {section}: add or remove keys"
