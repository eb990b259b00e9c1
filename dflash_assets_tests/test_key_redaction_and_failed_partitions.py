"""Issue 16, acceptance 4 and 5, and the probe's messages.

4. A stand-in server that echoes the bearer token (its Authorization header) in its error reply to the
   start-up probe: the main job (`python -m dflash_assets run`, a subprocess) fails naming the URL, and
   the key is in no file under DAGSTER_HOME or the storage root, nor in the output. Row errors and
   generated text that echo the key are redacted before they reach the journal, the table or the run DB.
5. A partition whose rows all fail (fewer than ``max_consecutive_failures``: 2 rows, limit 20) ends in a
   failed run quoting the first errors, keeps its finished rows checkpointed, and a rerun with a good
   server completes it.

The stand-in servers (:class:`FakeServer`) speak HTTP on a real socket; they stand in for what a real
server cannot be made to do on demand (echo the key, fail every row).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import dagster as dg
import pytest

from dflash_assets.assets.completions import completions
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.generation.api.urls import api_root, chat_completions_url, redact
from dflash_assets.generation.rows.journal import RowJournal
from dflash_assets.generation.servers.group import LaunchCommand
from dflash_assets.generation.servers.pool import API_KEY_ENV
from dflash_assets.generation.servers.probe import probe_chat, probe_external
from dflash_assets.generation.servers.sglang_servers import SGLangServers
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.behaviours import Error, Raw, Reply
from dflash_simulators.counting_proxy import last_user_message
from dflash_simulators.stand_in_server import FakeServer

KEY = "sk-h16-0123456789-THE-SECRET"
PROMPTS = ["Write a function that adds two numbers.", "Write a function that reverses a list."]


def files_holding(key: str, *roots: Path) -> list[str]:
    hits = []
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file() and key.encode() in path.read_bytes():
                hits.append(str(path))
    return hits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- URL rule and probe


def test_probe_and_client_share_one_url_rule():
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert chat_completions_url(base) == "http://h:1/v1/chat/completions"
        assert api_root(base) == "http://h:1/v1"
    from dflash_assets.generation.client.routing import ServerState

    assert (
        ServerState("http://h:1").endpoint
        == ServerState("http://h:1/v1").endpoint
        == chat_completions_url("http://h:1")
    )


def test_probe_of_a_base_url_without_v1_reaches_the_clients_endpoint():
    """Issue 16: a base URL without /v1 was probed at /chat/completions while the client used /v1/chat/completions."""
    seen = []

    def script(n, body):
        seen.append(n)
        return Reply()

    with FakeServer(script) as server:  # serves /v1/chat/completions
        reply = probe_chat(server.url, "fake")
    assert reply["choices"] and seen == [0]


def test_probe_of_a_dead_port_names_the_url_and_what_to_try():
    """Issue 16: a probe failure was a bare "Connection refused" with no URL."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as err:
        probe_external(url, "fake", timeout_s=5)
    msg = str(err.value)
    assert f"probe POST {url}/v1/chat/completions failed: ConnectError" in msg
    assert f"curl {url}/v1/models" in msg and "is the server running" in msg


def test_probe_reply_that_is_not_json_names_the_url():
    """Issue 16: a non-JSON probe reply raised a bare JSONDecodeError."""
    with FakeServer(Raw(200, b"<html>proxy login</html>")) as server, pytest.raises(RuntimeError) as err:
        probe_chat(server.url + "/v1", "fake")
    msg = str(err.value)
    assert (
        f"probe POST {server.url}/v1/chat/completions got a reply that is not JSON: '<html>proxy login</html>'" in msg
    )
    assert "OpenAI-compatible" in msg


def test_probe_http_errors_say_what_to_try():
    with (
        FakeServer(Error(404, "Not Found")) as server,
        pytest.raises(RuntimeError, match=r"got HTTP 404: .*check base_urls"),
    ):
        probe_chat(server.url, "fake")
    with (
        FakeServer(Error(400, "model 'x' not found")) as server,
        pytest.raises(RuntimeError, match=r"got HTTP 400: .*check served_model_name 'x'"),
    ):
        probe_chat(server.url, "x")
    with FakeServer(Error(401, "invalid token", echo_auth=True)) as server, pytest.raises(RuntimeError) as err:
        probe_chat(server.url, "fake", api_key=KEY)
    assert KEY not in str(err.value) and "***" in str(err.value) and "DFLASH_SERVER_API_KEY" in str(err.value)


def test_redact():
    assert redact(f"Bearer {KEY} and {KEY}", KEY) == "Bearer *** and ***"
    assert redact("nothing", None) == "nothing" and redact("a", [None, ""]) == "a"


def test_sglang_log_that_prints_the_key_is_redacted_in_the_file_and_the_error(tmp_path):
    """SGLang logs its whole ServerArgs (the key from its ``--config`` file included) at start-up; a server
    that prints them and dies must leave the key in neither its log file nor the start-up error (found in
    review)."""
    script = (
        "import sys, yaml; args = sys.argv[1:]; key = yaml.safe_load(open(args[args.index('--config') + 1]))"
        "['api-key']; print('server_args=', args, 'api_key=', repr(key), flush=True); sys.exit(3)"
    )
    command = LaunchCommand((sys.executable, "-c", script), {}, "127.0.0.1", free_port(), api_key_env="H16_TEST_KEY")
    with (
        pytest.raises(RuntimeError) as err,
        SGLangServers([command], tmp_path / "logs", api_key=KEY, startup_timeout_s=30.0, parent_death_signal=False),
    ):
        pass
    message = str(err.value)
    assert "exited with code 3" in message and KEY not in message and "api_key= '***'" in message
    log = (tmp_path / "logs" / "sglang_0.log").read_text()
    assert "# launch:" in log and "api_key= '***'" in log and KEY not in log


# ------------------------------------------------------------------ 4. the key never leaves through the probe


def test_key_echoed_by_the_probe_reply_is_in_no_file_and_no_output(main_job):
    with FakeServer(Error(401, "invalid token", echo_auth=True)) as server:
        job = main_job(server.url, PROMPTS, env={API_KEY_ENV: KEY})
        proc = job.run()
        assert any(KEY in (h or "") for h in server.auth_headers)  # the server did get (and echo) the key
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert f"probe POST {server.url}/v1/chat/completions got HTTP 401" in output and "Bearer ***" in output
    assert KEY not in output
    assert files_holding(KEY, job.home, job.data) == []
    assert any(job.home.rglob("*.db"))  # the run database exists and was searched


# ---------------------------------------------- 5. every row fails: a failed run; rows redacted and checkpointed


def inference_for(url: str, **fields) -> InferenceServerResource:
    return InferenceServerResource(
        **{
            "mode": "external",
            "base_urls": [url],
            "served_model_name": "fake",
            "external_backend": "openai",
            "max_running_requests": 2,
            "max_attempts": 1,
            "max_consecutive_failures": 20,
            "request_timeout_s": 5.0,
            "startup_timeout_s": 10.0,
            "api_key": dg.EnvVar(API_KEY_ENV),
            **fields,
        }
    )


def run_completions(instance, root: Path, pk: str, url: str):
    return dg.materialize(
        [completions],
        instance=instance,
        partition_key=pk,
        raise_on_error=False,
        resources={
            "storage": StorageResource(root=str(root)),
            "inference": inference_for(url),
            "target_model": TargetModelResource(),
            "generation": GenerationResource(max_output_tokens=16, temperature=0.0),
        },
    )


def test_partition_whose_rows_all_fail_fails_its_run_then_a_good_server_completes_it(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    root, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))

    def leaky(n, body):
        if last_user_message(body) not in PROMPTS:
            return Reply(content=f"hello, your key is {KEY}")  # the probe; its generated text echoes the key
        return Error(400, "bad request", echo_auth=True)  # not transient: one attempt per row

    with dg.instance_for_test(temp_dir=str(home)) as instance:
        corpus = dg.materialize(
            [prompt_corpus],
            instance=instance,
            resources={"storage": StorageResource(root=str(root))},
            run_config={"ops": {"prompt_corpus": {"config": {"sources": [str(source)], "partition_size": 2}}}},
        )
        assert corpus.success
        (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
        with FakeServer(leaky) as server:
            result = run_completions(instance, root, pk, server.url)
        assert not result.success
        message = result.get_step_failure_events()[0].event_specific_data.error.message
        assert f"{pk}: all 2 rows ended in error; first errors: row 0: HTTP 400 from {server.url}" in message
        assert "Bearer ***" in message and KEY not in message and "rerun the partition" in message
        assert instance.get_latest_materialization_event(dg.AssetKey("completions")) is None  # not recorded as done
        assert not (root / "completions" / f"{pk}.parquet").exists()
        journal = RowJournal(root / "completions" / f"{pk}.journal.jsonl").load()
        assert sorted(journal) == [0, 1] and all("Bearer ***" in r["error"] for r in journal.values())

        good = []

        def healthy(n, body):
            text = last_user_message(body)
            if text in PROMPTS:
                good.append(text)
                return Reply(content=f"Answer {PROMPTS.index(text)}. key {KEY}", reasoning=None, completion_tokens=4)
            return Reply()

        with FakeServer(healthy) as server2:
            rerun = run_completions(instance, root, pk, server2.url)
        assert rerun.success
        meta = {k: v.value for k, v in rerun.asset_materializations_for_node("completions")[0].metadata.items()}
        assert meta["errors"] == 0 and meta["rows"] == 2 and meta["request_reasons"] == {"error": 2}
        assert sorted(good) == sorted(PROMPTS)
        import polars as pl

        frame = pl.read_parquet(root / "completions" / f"{pk}.parquet")
        assert frame["content"].to_list() == ["Answer 0. key ***", "Answer 1. key ***"]
    assert files_holding(KEY, home, root) == []
