"""Issue 32, finding 2: "up to date" means the outputs are in the configured storage.

The input that showed it: a pipeline materialized under one storage root, then ``DFLASH_STORAGE_ROOT``
pointed elsewhere (or ``dflash_data`` deleted, the Dagster instance kept): every record still said
materialized, ``run`` said everything was up to date and the summary pointed at files that were not
there. Here the real ``tokenized_sequences`` asset writes into a real root, a real instance records it,
and the freshness rule is asked about that root, another one, and the root with its files deleted.
"""

from __future__ import annotations

import shutil

import dagster as dg

from dflash_assets.assets.prompts import corpus_fingerprint
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.prompts import PromptCorpusConfig
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.storage.stage_outputs import missing_outputs
from dflash_assets.storage.store import Storage
from dflash_assets_tests.s3_fixtures import moto_server, s3_env, s3_target  # noqa: F401
from dflash_assets_tests.test_check_gate import PK, QUESTIONS, tokenize, write_completions


def test_the_corpus_fingerprint_changes_with_the_storage_root(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "hello"}\n')
    config = PromptCorpusConfig(sources=[str(source)])
    here = corpus_fingerprint(config, StorageResource(root=str(tmp_path / "a")))
    assert here == corpus_fingerprint(config, StorageResource(root=str(tmp_path / "a")))
    assert here != corpus_fingerprint(config, StorageResource(root=str(tmp_path / "b")))


def test_a_stage_whose_output_is_not_in_the_configured_storage_needs_work(tmp_path):
    root, other = tmp_path / "data", tmp_path / "elsewhere"
    write_completions(root, {i: " ".join(["word"] * (3 + 4 * i)) + "." for i in QUESTIONS})
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(prompt_ranges.name, [PK])
        instance.report_runless_asset_event(dg.AssetMaterialization("completions", partition=PK))
        assert tokenize(instance, root).success

        def reason(store_root) -> str | None:
            return freshness.partition_reason(
                instance, "tokenized_sequences", PK, upstream="completions", store=Storage(str(store_root))
            )

        assert reason(root) is None
        # another root (DFLASH_STORAGE_ROOT changed): the records are the same, the table is not there
        assert reason(other) == f"output missing: {other / 'tokenized_sequences' / f'{PK}.parquet'}"
        # the completions table: same rule, under the generation settings
        completions = freshness.partition_reasons(
            instance, "completions", [PK], GenerationSettings(max_output_tokens=64), store=Storage(str(other))
        )
        assert completions == {PK: f"output missing: {other / 'completions' / f'{PK}.parquet'}"}
        # dflash_data deleted, the instance kept
        shutil.rmtree(root)
        assert reason(root) == f"output missing: {root / 'tokenized_sequences' / f'{PK}.parquet'}"
        assert freshness.output_reason(Storage(str(root)), "prompt_corpus") == (
            f"output missing: {root / 'prompt_corpus' / 'corpus.parquet'}"
        )


def test_missing_outputs_reads_the_index_each_partition_wrote(tmp_path):
    store = Storage(str(tmp_path))
    keys = ["0000000-0000003", "0000004-0000007", "0000008-0000011"]
    for pk in keys[:2]:
        store.write_json({"shards": []}, "hidden_states", pk, "index.json")
    # shards without their index: the extraction did not finish, the partition is not there
    store.write_bytes(b"x", "hidden_states", keys[2], "shard-00000.safetensors")
    assert missing_outputs(store, "hidden_states", keys) == {
        keys[2]: str(tmp_path / "hidden_states" / keys[2] / "index.json")
    }
    assert missing_outputs(Storage(str(tmp_path / "none")), "tokenized_sequences", keys[:1]) == {
        keys[0]: str(tmp_path / "none" / "tokenized_sequences" / f"{keys[0]}.parquet")
    }


def test_missing_outputs_on_s3_lists_the_prefix_once(s3_target, tmp_path):  # noqa: F811
    """On S3 the listing gives ``bucket/prefix/...`` paths: present tables must not read as missing."""
    resource = StorageResource(
        root=s3_target.root,
        scratch_dir=str(tmp_path / "scratch"),
        endpoint_url=s3_target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
    ).process_config_and_initialize()
    store = resource.open()
    keys = ["0000000-0000003", "0000004-0000007"]
    store.write_bytes(b"table", "completions", f"{keys[0]}.parquet")
    store.write_bytes(b"segment", "completions", f"{keys[1]}.journal", "seg-000001.jsonl")  # no table yet
    assert missing_outputs(store, "completions", keys) == {keys[1]: f"{s3_target.root}/completions/{keys[1]}.parquet"}
    store.write_json({"shards": []}, "hidden_states", keys[1], "index.json")
    assert missing_outputs(store, "hidden_states", keys) == {
        keys[0]: f"{s3_target.root}/hidden_states/{keys[0]}/index.json"
    }
    # a prefix with nothing under it: all missing, no error
    other = StorageResource(
        root=s3_target.root + "-other",
        endpoint_url=s3_target.endpoint_url,
        region="us-east-1",
        aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"),
    ).process_config_and_initialize()
    assert set(missing_outputs(other.open(), "completions", keys)) == set(keys)
