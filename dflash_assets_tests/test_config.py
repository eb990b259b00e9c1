"""Config file validation (issue 16: `generation: {max_output_token: 64}` ran silently at cap 4,096, so did
a typo'd resource name, and YAML errors did not name the file). Each bad input gets an error naming the
key, where it is, the valid keys and the file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.common import config as cfg
from dflash_assets.stages import config_schema
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.storage import StorageResource

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"generation": GenerationResource, "storage": StorageResource}


def write(tmp_path, text: str, monkeypatch) -> Path:
    path = tmp_path / "my_config.yaml"
    path.write_text(text)
    monkeypatch.setenv("DFLASH_CONFIG", str(path))
    return path


def error_of(fn, *args) -> str:
    with pytest.raises(cfg.ConfigError) as err:
        fn(*args)
    return str(err.value)


def project_assets():
    """The project's asset definitions, imported before a test points DFLASH_CONFIG at a bad file."""
    return ASSETS


from dflash_assets.app.stage_order import ASSETS  # noqa: E402  (with the bundled config)


def test_typo_in_a_resource_field_is_an_error_naming_key_place_valid_keys_and_file(tmp_path, monkeypatch):
    path = write(tmp_path, "resources:\n  generation: {max_output_token: 64}\n", monkeypatch)
    msg = error_of(cfg.build_resources, CLASSES)
    assert msg.startswith(f"{path}: resources.generation: unknown key 'max_output_token'")
    assert "did you mean 'max_output_tokens'?" in msg and "valid keys:" in msg and "temperature" in msg


def test_every_project_resource_rejects_an_unknown_field(tmp_path, monkeypatch):
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    classes = {**CLASSES, "inference": InferenceServerResource, "target_model": TargetModelResource}
    for name in classes:
        path = write(tmp_path, f"resources:\n  {name}: {{no_such_field: 1}}\n", monkeypatch)
        assert f"{path}: resources.{name}: unknown key 'no_such_field'" in error_of(cfg.build_resources, classes)


def test_typo_in_a_resource_name_is_an_error(tmp_path, monkeypatch):
    path = write(tmp_path, "resources:\n  generaton: {max_output_tokens: 64}\n", monkeypatch)
    msg = error_of(cfg.build_resources, CLASSES)
    assert msg.startswith(f"{path}: resources: unknown resource 'generaton' (did you mean 'generation'?)")
    assert "valid resources: generation, storage" in msg


def test_a_bad_value_names_the_file_and_the_resource(tmp_path, monkeypatch):
    path = write(tmp_path, "resources:\n  generation: {max_output_tokens: lots}\n", monkeypatch)
    msg = error_of(cfg.build_resources, CLASSES)
    assert msg.startswith(f"{path}: resources.generation: ") and "max_output_tokens" in msg and "integer" in msg


@pytest.mark.parametrize("value", ["true", '"20"', "20.0"])
def test_a_cap_that_only_looks_like_a_number_is_an_error(tmp_path, monkeypatch, value):
    """`max_output_tokens: true` was taken as cap 1, and a run then cut every row to one token (a
    new-user trial); a string or a float is as likely a slip."""
    write(tmp_path, f"resources:\n  generation: {{max_output_tokens: {value}}}\n", monkeypatch)
    msg = error_of(cfg.build_resources, CLASSES)
    assert "max_output_tokens" in msg and "valid integer" in msg


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("tail_chunk_tokens", "true", "valid integer"),
        ("max_running_requests", "true", "valid integer"),
        ("continue_truncated", '"no"', "valid boolean"),
        ("tail_prompts_per_slot", ".inf", "finite number"),
    ],
)
def test_an_inference_number_or_switch_that_only_looks_like_one_is_an_error(tmp_path, monkeypatch, key, value, kind):
    """`tail_chunk_tokens: true` was taken as 1-token chunks (as `max_output_tokens: true` was a cap of 1);
    `tail_prompts_per_slot: .inf` passed and crashed the run after the servers had started."""
    from dflash_assets.stages.resources.inference import InferenceServerResource

    write(tmp_path, f"resources:\n  inference: {{{key}: {value}}}\n", monkeypatch)
    msg = error_of(cfg.build_resources, {"inference": InferenceServerResource})
    assert key in msg and kind in msg, msg


@pytest.mark.parametrize(
    "resource, key, env",
    [
        ("inference", "api_key", "DFLASH_SERVER_API_KEY"),
        ("storage", "aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("storage", "aws_access_key_id", "AWS_ACCESS_KEY_ID"),
        ("storage", "aws_session_token", "AWS_SESSION_TOKEN"),
    ],
)
def test_a_secret_in_the_config_file_is_refused_naming_the_variable_to_use(tmp_path, monkeypatch, resource, key, env):
    """Issue 27: a literal key in the YAML was accepted, and Dagster shows resource values that are not
    EnvVars in the UI and over GraphQL. The value itself is not repeated in the message."""
    from dflash_assets.stages.resources.inference import InferenceServerResource

    path = write(tmp_path, f"resources:\n  {resource}: {{{key}: sk-literal-0451}}\n", monkeypatch)
    msg = error_of(cfg.build_resources, {**CLASSES, "inference": InferenceServerResource})
    assert msg.startswith(f"{path}: resources.{resource}.{key}: a secret cannot be set in the config file")
    assert f"set the environment variable {env} instead" in msg and "sk-literal-0451" not in msg
    # the same value from the environment (an EnvVar reference) is what the file must not hold
    monkeypatch.setenv(env, "sk-from-env")
    write(tmp_path, f"resources:\n  {resource}: {{}}\n", monkeypatch)
    classes = {"inference": InferenceServerResource, "storage": StorageResource}
    import dagster as dg

    built = cfg.build_resources(classes, extra={resource: {key: dg.EnvVar(env)}})
    assert getattr(built[resource], key) == dg.EnvVar(env)


def test_yaml_error_names_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, "resources:\n  generation: {max_output_tokens: 64\n", monkeypatch)
    msg = error_of(cfg.project_config)
    assert msg.startswith(f"{path}: not valid YAML:") and "line" in msg


def test_unknown_top_level_key(tmp_path, monkeypatch):
    path = write(tmp_path, "resource:\n  generation: {}\n", monkeypatch)
    assert error_of(cfg.project_config) == (
        f"{path}: top level: unknown key 'resource' (did you mean 'resources'?); valid keys: ops, resources"
    )


def test_unknown_op_name(tmp_path, monkeypatch):
    path = write(tmp_path, "ops:\n  prompt_corpuz: {config: {max_prompts: 3}}\n", monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    assert msg.startswith(f"{path}: ops: unknown op 'prompt_corpuz' (did you mean 'prompt_corpus'?)")
    assert "completions" in msg and "dflash_drafter" in msg


def test_unknown_op_config_key_and_bad_type(tmp_path, monkeypatch):
    path = write(tmp_path, "ops:\n  prompt_corpus: {config: {max_prompt: 3}}\n", monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    # the fix said as for a resource's unknown key: the closest key, then every valid one (the new user's run of
    # issue 52's stop got Dagster's schema dump instead)
    assert msg.startswith(f"{path}: ops.prompt_corpus.config: unknown key 'max_prompt' (did you mean 'max_prompts'?)")
    assert "valid keys: " in msg and "partition_size" in msg and "{" not in msg
    path = write(tmp_path, "ops:\n  prompt_corpus: {config: {partition_size: big}}\n", monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    assert msg.startswith(f"{path}: ops.prompt_corpus.config: ") and "partition_size" in msg
    path = write(tmp_path, "ops:\n  prompt_corpus: {configs: {}}\n", monkeypatch)
    assert error_of(config_schema.validate_ops, project_assets()).startswith(
        f"{path}: ops.prompt_corpus: unknown key 'configs'"
    )


def test_the_completions_mode_is_read_from_the_config_file_and_checked(tmp_path, monkeypatch):
    write(tmp_path, "ops:\n  completions: {config: {mode: on_policy, max_rounds_per_user_turn: 2}}\n", monkeypatch)
    config_schema.validate_ops(project_assets())
    path = write(tmp_path, "ops:\n  completions: {config: {mode: on-policy}}\n", monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    assert msg.startswith(f"{path}: ops.completions.config: ") and "on-policy" in msg and "on_policy" in msg


@pytest.mark.parametrize(
    ("op", "setting"),
    [
        # issue 50, finding 9: these passed the start-up check; `truncated: Keep` failed only after every
        # completion was generated, as `bad policy TokenizePolicy(...)`, naming no key
        ("completions", "max_turns_per_conversation: 5000"),
        ("tokenized_sequences", "truncated: Keep"),
        ("prompt_corpus", "partition_size: 0"),
        ("tokenized_sequences", "over_max_length: trim"),
        ("tokenized_sequences", "degenerate_share: 1.5"),
        ("completions", "max_rounds_per_user_turn: 0"),
        ("dflash_drafter", "block_size: 1"),
    ],
)
def test_a_bound_or_an_enumerated_word_is_checked_at_start_up_naming_the_key(tmp_path, monkeypatch, op, setting):
    path = write(tmp_path, f"ops:\n  {op}: {{config: {{{setting}}}}}\n", monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    key, value = setting.split(": ")
    assert msg.startswith(f"{path}: ops.{op}.config") and key in msg and value in msg, msg


@pytest.mark.parametrize(
    ("source", "said"),
    [  # issue 50, finding 10: taken silently at start-up, refused only when the corpus built
        ("bfcl:multi_turn_base?limit=3&limit=2", "given more than once"),
        ("bfcl:multi_turn_base#x", "suffix"),
        ("bfcl:multi_turn_base?limit=\u00b2", "limit must be a positive integer"),
    ],
)
def test_a_bfcl_sources_options_are_checked_at_start_up(tmp_path, monkeypatch, source, said):
    path = write(tmp_path, f'ops:\n  prompt_corpus: {{config: {{sources: ["{source}"]}}}}\n', monkeypatch)
    msg = error_of(config_schema.validate_ops, project_assets())
    assert msg.startswith(f"{path}: ops.prompt_corpus.config.sources") and said in msg, msg


def test_bundled_configs_are_valid(monkeypatch):
    for path in sorted(cfg.BUNDLED.glob("*.yaml")):
        monkeypatch.setenv("DFLASH_CONFIG", str(path))
        config_schema.validate_ops(project_assets())
        assert set(
            cfg.build_resources({"generation": GenerationResource, "storage": StorageResource, **_other_classes()})
        )


def _other_classes():
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    return {"inference": InferenceServerResource, "target_model": TargetModelResource}


def test_cli_run_with_a_typo_stops_before_any_work(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("resources:\n  generation: {max_output_token: 64}\n")
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DFLASH_STORAGE_ROOT": str(tmp_path / "data")}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert f"config error: {path}: resources.generation: unknown key 'max_output_token'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


def test_fingerprint_cache_follows_a_copy_with_other_values():
    """The fingerprint and settings JSON are cached per distinct settings (not recomputed per row);
    a copy with another temperature must not reuse the original's."""
    from dflash_assets.common.settings import GenerationSettings

    base = GenerationSettings()
    assert base.sampling_fingerprint() == GenerationSettings(max_output_tokens=8192).sampling_fingerprint()
    copied = base.model_copy(update={"temperature": 0.1})
    fresh = GenerationSettings(temperature=0.1)
    assert copied.sampling_fingerprint() == fresh.sampling_fingerprint() != base.sampling_fingerprint()
    assert '"temperature": 0.1' in copied.settings_json and '"temperature": 0.6' in base.settings_json


def test_a_seed_sglang_would_ignore_is_refused_before_any_work(tmp_path):
    """Issue 38: SGLang drops a request's seed unless its servers run with --enable-deterministic-inference, yet
    every row recorded the seed as used. The run stops at config time naming both keys and the fix."""
    path = tmp_path / "seeded.yaml"
    path.write_text(
        "resources:\n  inference: {mode: sglang, sglang: {model_path: /models/m}}\n  generation: {seed: 7}\n"
    )
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DFLASH_STORAGE_ROOT": str(tmp_path / "data")}
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_assets", "run", "--config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"config error: {path}: resources.generation.seed is 7 but SGLang ignores" in proc.stderr
    assert "add --enable-deterministic-inference to resources.inference.sglang.extra_args" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    "inference, seed, refused",
    [
        ("{mode: sglang, sglang: {model_path: /m}}", 7, True),
        ("{mode: sglang, sglang: {model_path: /m, extra_args: [--enable-deterministic-inference]}}", 7, False),
        ("{mode: sglang, sglang: {model_path: /m}}", None, False),
        ("{mode: local}", 7, False),  # only SGLang is known to drop it
    ],
)
def test_the_seed_check_refuses_only_an_sglang_without_deterministic_inference(
    tmp_path, monkeypatch, inference, seed, refused
):
    generation = "{}" if seed is None else f"{{seed: {seed}}}"
    write(tmp_path, f"resources:\n  inference: {inference}\n  generation: {generation}\n", monkeypatch)
    built = cfg.build_resources({"generation": GenerationResource, **_other_classes()})
    if refused:
        assert "--enable-deterministic-inference" in error_of(config_schema.check_seed, built)
    else:
        config_schema.check_seed(built)


def test_the_root_schema_is_the_assets_own():
    """stages/config_schema.py names every key of the file in one place: each asset with the config type it
    takes and each resource an asset takes with its class, as the assets declare them (issue 51)."""
    import typing

    import dagster as dg

    from dflash_assets.stages.config_schema import OP_CONFIGS, RESOURCE_CLASSES

    taken = set()
    for assets_def in ASSETS:
        hints = typing.get_type_hints(assets_def.op.compute_fn.decorated_fn).values()
        types = [h for h in hints if isinstance(h, type) and issubclass(h, dg.Config)]
        resources = {h for h in types if issubclass(h, dg.ConfigurableResource)}
        configs = [h for h in types if h not in resources]
        for key in assets_def.keys:
            assert OP_CONFIGS[key.to_user_string()] == (configs[0] if configs else None), key
        taken |= resources
    assert set(OP_CONFIGS) == {k.to_user_string() for a in ASSETS for k in a.keys}
    assert taken <= set(RESOURCE_CLASSES.values())
    reference = (ROOT / "docs" / "configuration.md").read_text()
    named = [f"resources.{name}" for name in RESOURCE_CLASSES]
    named += [f"ops.{name}.config" for name, cls in OP_CONFIGS.items() if cls is not None]
    assert not [n for n in named if f"## `{n}`" not in reference], "docs/configuration.md lacks a section"
