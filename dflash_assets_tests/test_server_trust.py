"""Issue 27, trust in the inference servers we start: the API key never on a command line, a server
trusted only once it is provably our child, crash-looping servers not restarted forever, and settings
that expose the servers or the key said out loud.

The servers are the GPU-node simulator (``dflash_simulators.sglang_stub``, a real process
speaking SGLang's protocol and taking its flags, ``--config`` included); the squatter is a real process
listening on the port and recording every byte it receives.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import httpx
import pytest

from dflash_assets.generation.processes.ports import PortTakenError, free_port, free_port_block
from dflash_assets.generation.processes.proc_info import session_members
from dflash_assets.generation.servers import group as server_group
from dflash_assets.generation.servers.group import LaunchCommand, write_key_config
from dflash_assets.generation.servers.pool import API_KEY_ENV
from dflash_assets.generation.servers.sglang_servers import SGLangServers, build_sglang_commands
from dflash_assets.generation.servers.supervision import ProcessSupervisor
from dflash_assets.stages.resources.inference import InferenceServerResource

KEY = "sk-i27-ps-must-not-show-0b5e"
STUB = "dflash_simulators.sglang_stub"
FAST = ["--sim-startup-s", "0.3", "--sim-speed", "1", "--sim-median-tokens", "4", "--sim-sigma", "0.1"]

SQUATTER = """
import socket, sys
port, out = int(sys.argv[1]), sys.argv[2]
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen()
open(out + ".ready", "w").close()
while True:  # answers 200 to anything, as the old health check wanted, and keeps what it was sent
    c, _ = s.accept()
    data = c.recv(65536)
    with open(out, "ab") as f:
        f.write(data)
    c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
    c.close()
"""


def start_squatter(port: int, out: Path) -> subprocess.Popen:
    out.write_bytes(b"")
    proc = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port), str(out)], start_new_session=True)
    deadline = time.monotonic() + 20
    while not Path(f"{out}.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "squatter did not start"
        time.sleep(0.05)
    return proc


def all_command_lines() -> dict[int, bytes]:
    lines = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                lines[int(name)] = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                pass
    return lines


def test_api_key_reaches_the_sglang_servers_without_any_command_line(tmp_path, monkeypatch):
    """Acceptance: sglang mode with the simulator and a key; while the servers run, `ps` and every
    /proc/<pid>/cmdline hold no key, the servers' environment does not either, the key file is gone, and
    yet the servers demand the key (401 without it, 200 with it): it reached them through --config."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    inference = InferenceServerResource(
        mode="sglang",
        model_path="sim-model",
        num_servers=2,
        port_base=free_port_block(2),
        launch_module=STUB,
        extra_args=FAST,
        api_key=KEY,
        startup_timeout_s=60.0,
        max_running_requests=2,
    )
    with inference.serve(tmp_path / "logs") as pool:
        servers = pool.supervisor.servers
        pids = [p for proc in servers._procs for p in session_members(proc.pid)]
        assert len(pids) >= 2
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
        assert "--config" in ps and "sglang_stub" in ps  # ps does show the servers' command lines
        assert KEY not in ps
        assert [pid for pid, line in all_command_lines().items() if KEY.encode() in line] == []
        for pid in pids:
            assert KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
        assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()] == []  # key files dropped once up
        for url in pool.base_urls:
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(f"{url}/chat/completions", json=body, timeout=30).status_code == 401
            ok = httpx.post(f"{url}/chat/completions", json=body, headers=pool.headers(), timeout=30)
            assert ok.status_code == 200 and ok.json()["choices"]
    assert list((tmp_path / "tmp").iterdir()) == []  # the key directory is removed on stop
    for i in range(2):
        log = (tmp_path / "logs" / f"sglang_{i}.log").read_text()
        assert "api_key='***'" in log and KEY not in log  # the stub prints its ServerArgs, as SGLang does


def test_key_file_is_private_and_holds_what_sglang_reads(tmp_path):
    """The file SGLang's --config reads: mode 0600, new (O_EXCL), `api-key: <key>`, a .yaml name."""
    import yaml

    from dflash_simulators.sglang_stub import parse_args

    path = write_key_config(tmp_path, KEY)
    assert path.suffix == ".yaml" and (path.stat().st_mode & 0o777) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": KEY}
    assert parse_args(["--port", "1", "--config", str(path)]).api_key == KEY
    assert parse_args(["--config", str(path), "--api-key", "from-the-command-line"]).api_key == "from-the-command-line"
    (cmd,) = build_sglang_commands("/m", api_key_env=API_KEY_ENV, extra_args=["--enable-metrics"])
    assert cmd.launch_argv(path)[-2:] == ["--config", str(path)] and KEY not in " ".join(cmd.launch_argv(path))
    with pytest.raises(ValueError, match="--config"):
        build_sglang_commands("/m", api_key_env=API_KEY_ENV, extra_args=["--config", "mine.yaml"])


def test_router_mode_refuses_a_key_it_could_only_put_on_its_command_line():
    with pytest.raises(ValueError, match="use_router with an API key"):
        InferenceServerResource(mode="sglang", model_path="/m", use_router=True, api_key=KEY).sglang_commands()


def test_a_squatter_on_the_port_before_launch_is_refused_and_sent_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    port = free_port_block(1)
    squatter = start_squatter(port, tmp_path / "received")
    try:
        commands = build_sglang_commands("sim", port_base=port, module=STUB, extra_args=FAST, api_key_env=API_KEY_ENV)
        started = time.monotonic()
        with (
            pytest.raises(PortTakenError) as err,
            SGLangServers(commands, tmp_path / "logs", api_key=KEY, startup_timeout_s=30.0),
        ):
            pass
        elapsed = time.monotonic() - started
        message = str(err.value)
        assert f"port {port} on 127.0.0.1 is held by pid {squatter.pid}" in message
        assert "nothing was sent to it (no request, no API key)" in message and "inference.sglang.port_base" in message
        assert not (tmp_path / "logs" / "sglang_0.log").exists()  # refused before anything started
        assert (tmp_path / "received").read_bytes() == b""
        print(f"squatter before launch: refused in {elapsed:.2f} s")
    finally:
        squatter.kill()
        squatter.wait()


def test_a_squatter_that_takes_the_port_while_the_server_loads_is_refused_and_sent_nothing(tmp_path, monkeypatch):
    """SGLang binds only after loading the model: whatever listens first used to get the health probe,
    with the key, then the prompts. Here the squatter binds right after our server was started (the
    simulator still 'loading' for 3 s); the launcher refuses it at its first look and stops our server."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    port = free_port_block(1)
    squatters, children = [], []
    real_start = server_group.start_process

    def start_then_squat(*args, **kwargs):
        proc = real_start(*args, **kwargs)
        children.append(proc.pid)
        squatters.append(start_squatter(port, tmp_path / "received"))
        return proc

    monkeypatch.setattr(server_group, "start_process", start_then_squat)
    slow = ["--sim-startup-s", "3", "--sim-speed", "1"]
    commands = build_sglang_commands("sim", port_base=port, module=STUB, extra_args=slow, api_key_env=API_KEY_ENV)
    try:
        with (
            pytest.raises(PortTakenError) as err,
            SGLangServers(commands, tmp_path / "logs", api_key=KEY, startup_timeout_s=30.0),
        ):
            pass
        message = str(err.value)
        assert f"held by pid {squatters[0].pid}" in message and f"not SGLang server 0 (pid {children[0]})" in message
        assert (tmp_path / "received").read_bytes() == b""  # no health probe, no key, no prompt
        assert session_members(children[0]) == []  # our server was stopped
    finally:
        for squatter in squatters:
            squatter.kill()
            squatter.wait()


def test_local_server_refuses_a_taken_port_before_loading_anything(tmp_path):
    from dflash_assets.generation.engines.local_model import ensure_local_model
    from dflash_assets.generation.servers.transformers_server import LocalTransformersServer

    port = free_port()
    squatter = start_squatter(port, tmp_path / "received")
    try:
        with (
            pytest.raises(PortTakenError, match=f"port {port} on 127.0.0.1 is held by pid {squatter.pid}"),
            LocalTransformersServer(ensure_local_model(), port=port, log_path=tmp_path / "serve.log"),
        ):
            pass
        assert (tmp_path / "received").read_bytes() == b"" and not (tmp_path / "serve.log").exists()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_server_that_crashes_at_every_start_is_restarted_a_bounded_number_of_times(tmp_path, monkeypatch):
    """A crash loop was restarted forever. Here server 0 exits at once at every start after the first
    (the simulator refuses a bad flag): max_restarts=2 restarts, then a clear error naming its log."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    (cmd,) = build_sglang_commands("sim", port_base=free_port_block(1), module=STUB, extra_args=FAST)
    with SGLangServers([cmd], tmp_path / "logs", startup_timeout_s=30.0) as servers:
        supervisor = ProcessSupervisor(servers, max_restarts=2)
        servers.commands[0] = dataclasses.replace(cmd, argv=(*cmd.argv, "--sim-speed", "0"))  # exits at start
        attempts = []
        for _ in range(4):
            try:
                supervisor.recover(0)
                attempts.append("restarted")
            except RuntimeError as exc:
                attempts.append(str(exc))
        starts = (tmp_path / "logs" / "sglang_0.log").read_text().count("# launch:")
    assert all("exited with code 2" in a for a in attempts[:2]), attempts
    for refused in attempts[2:]:
        assert refused.startswith(f"not restarted: see its log {tmp_path / 'logs' / 'sglang_0.log'}")
        assert "restarted 2 times in 60 min (inference.max_server_restarts 2)" in refused
    assert starts == 3  # the first start and two restarts, no more


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"mode": "sglang", "host": "0.0.0.0"}, "inference.sglang.host '0.0.0.0' with no API key"),
        ({"mode": "sglang", "host": "0.0.0.0", "api_key": KEY}, None),
        ({"mode": "sglang", "host": "127.0.0.1"}, None),
        (
            {"mode": "external", "base_urls": ["http://10.1.2.3:30000/v1"], "api_key": KEY},
            "the API key is sent in clear text over http:// to 10.1.2.3",
        ),
        (
            {"mode": "external", "base_urls": ["https://gpu.example/v1", "http://localhost:30000/v1"], "api_key": KEY},
            None,
        ),
        ({"mode": "external", "base_urls": ["http://10.1.2.3:30000/v1"]}, None),
    ],
)
def test_settings_that_expose_the_servers_or_the_key_are_warned_about(fields, expected):
    warnings = InferenceServerResource(model_path="m", served_model_name="m", **fields).exposure_warnings()
    assert warnings == [] if expected is None else (len(warnings) == 1 and warnings[0].startswith(expected))
    assert all(KEY not in w for w in warnings)


def test_an_exposed_server_is_warned_about_in_the_run_log_and_the_completions_metadata(tmp_path, monkeypatch):
    from dflash_assets_tests.test_completions_asset import write_corpus
    from dflash_assets_tests.test_node_scale import range_materialize, sglang_sim

    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    root = tmp_path / "data"
    with dg.instance_for_test() as instance:
        keys = write_corpus(instance, root, ["prompt 0", "prompt 1"], partition_size=2)
        inference = sglang_sim(tmp_path, 1, 2, host="0.0.0.0")
        result = range_materialize(instance, root, keys, inference, cap=16)
        [materialization] = result.asset_materializations_for_node("completions")
        warnings = materialization.metadata["security_warnings"].value
        logged = [e.user_message for e in instance.all_logs(result.run_id) if e.level >= 30]
    assert warnings == inference.exposure_warnings()
    assert warnings[0].startswith("inference.sglang.host '0.0.0.0' with no API key")
    assert any(warnings[0] in line for line in logged)


def test_an_sglang_without_config_files_fails_saying_the_key_needs_one(tmp_path, monkeypatch):
    """An SGLang older than --config exits at start-up (argparse); the error says why and what to do."""
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(tmp_path / "registry"))
    script = "import argparse; p = argparse.ArgumentParser(); p.add_argument('--port'); p.parse_args()"
    command = LaunchCommand(
        (sys.executable, "-c", script, "--port", "1"), {}, "127.0.0.1", free_port(), api_key_env=API_KEY_ENV
    )
    with pytest.raises(RuntimeError) as err, SGLangServers([command], tmp_path / "logs", api_key=KEY):
        pass
    assert "exited with code 2; this SGLang takes no --config file" in str(err.value) and KEY not in str(err.value)


def test_a_port_block_is_drawn_whatever_the_global_seed():
    """Seen in the suite (test_drafter_quality's vLLM server refused with PortTakenError, its port held by another
    test's server): training seeds Python's global generator (random.seed(0)), so two processes that had trained
    with the same seed drew the same port block. The draw must neither read nor advance the global generator."""
    import random

    from dflash_assets.generation.processes.ports import free_port_block

    random.seed(0)
    state = random.getstate()
    free_port_block(2)
    assert random.getstate() == state


def test_a_block_drawn_by_one_process_is_not_drawn_by_another_while_its_server_loads(tmp_path, monkeypatch):
    """CI, stop 53 (test_cost): ``PortTakenError: port 28795 ... held by pid 13638 (python), not SGLang server 0
    (pid 13618)``: a block is free only until its server binds it (seconds for the simulator, minutes for a real
    engine), and a server of the other test process, drawing meanwhile, took the same port. A drawn block is claimed
    on the machine: another process drawing gets another block, until the claim is older than its time to live."""
    import random
    import subprocess
    import sys

    from dflash_assets.generation.processes import ports

    monkeypatch.setattr(ports, "_claims_dir", lambda: tmp_path / "claims")  # this test's claims only
    claimer = (
        "from pathlib import Path; from dflash_assets.generation.processes import ports; "
        f"ports._claims_dir = lambda: Path({str(tmp_path / 'claims')!r}); print(ports.free_port_block(3))"
    )
    base = int(subprocess.run([sys.executable, "-c", claimer], capture_output=True, text=True, check=True).stdout)
    taken = range(base, base + 3)
    assert sorted(int(p.name) for p in ports._claims_dir().iterdir()) == list(taken)  # claimed, past its process

    draws = iter([base + 1, base + 100])  # the other process's draw overlaps, then one that does not
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, lo, hi: next(draws))
    assert ports.free_port_block(2) == base + 100  # the overlapping block was free to bind, but claimed
    assert not ports.claim_ports(range(base + 2, base + 4))  # one port claimed: nothing claimed
    assert not (ports._claims_dir() / str(base + 3)).exists()
    assert ports.claim_ports(range(base + 2, base + 4), ttl_s=0.0)  # an old claim is taken over
