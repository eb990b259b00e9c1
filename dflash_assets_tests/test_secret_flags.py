"""Issue 32 finding 7: an API key given as a server flag is refused, naming the variable to use; a port
holder's command line never reaches an error; a launcher killed with SIGKILL leaves no key file behind
once the reaper has run (real processes, real kills)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.generation.processes.ports import PortTakenError, free_port
from dflash_assets.generation.servers.registry import reap_orphaned_servers, register_server
from dflash_assets.stages.resources.inference import InferenceServerResource

SECRET = "sk-i32-never-in-argv-4f1c"


@pytest.mark.parametrize(
    "extra_args",
    [["--api-key", SECRET], [f"--api-key={SECRET}"], ["--enable-metrics", "--api_key", SECRET], ["--api-ke", SECRET]],
)
def test_api_key_in_inference_extra_args_is_refused_naming_the_variable(extra_args):
    with pytest.raises(Exception) as err:
        InferenceServerResource(mode="sglang", model_path="/m", extra_args=extra_args)
    message = str(err.value)
    assert "inference.sglang.extra_args" in message and "DFLASH_SERVER_API_KEY" in message and "--api-key" in message
    assert SECRET not in message


def test_extra_args_without_a_secret_are_accepted_and_launched():
    server = InferenceServerResource(mode="sglang", model_path="/m", extra_args=["--api-keys-file-not-a-flag-x"])
    assert server.sglang.extra_args == ["--api-keys-file-not-a-flag-x"]  # longer than --api-key: another flag
    (cmd,) = InferenceServerResource(mode="sglang", model_path="/m", extra_args=["--enable-metrics"]).sglang_commands()
    assert "--enable-metrics" in cmd.argv


def test_refuse_secret_args_helper_for_the_evaluation_engine_args():
    from dflash_assets.generation.servers.secret_args import SecretArgError, refuse_secret_args

    refuse_secret_args(["--speculative-num-steps", "4"], "drafter_evaluation.engine_extra_args")
    with pytest.raises(SecretArgError) as err:
        refuse_secret_args(["--api-key", SECRET], "drafter_evaluation.engine_extra_args")
    assert "drafter_evaluation.engine_extra_args" in str(err.value) and "DFLASH_SERVER_API_KEY" in str(err.value)
    assert SECRET not in str(err.value)


def test_engine_flags_with_a_key_never_reach_a_launch_command():
    """The evaluation engine passes engine_extra_args through sglang_commands(extra_args=...)."""
    server = InferenceServerResource(mode="sglang", model_path="/m")
    with pytest.raises(ValueError, match="DFLASH_SERVER_API_KEY") as err:
        server.sglang_commands(extra_args=["--speculative-algorithm", "DFLASH", f"--api-key={SECRET}"])
    assert SECRET not in str(err.value)


LISTENER = (
    "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', int(sys.argv[1])))\ns.listen()\n"
    "open(sys.argv[2], 'w').close()\ntime.sleep(120)\n"
)


def test_port_taken_message_names_the_pid_and_program_not_the_command_line(tmp_path):
    from dflash_assets.generation.processes.ports import check_port_free

    port = free_port()
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), str(ready), "--api-key", SECRET])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(PortTakenError) as err:
            check_port_free("127.0.0.1", port)
        message = str(err.value)
        program = Path(f"/proc/{holder.pid}/comm").read_text().strip()
        assert f"held by pid {holder.pid} ({program})" in message
        assert SECRET not in message and "--api-key" not in message and "socket" not in message
    finally:
        holder.kill()
        holder.wait()


KEY_LAUNCHER = """
import json, os, sys, threading, time
from pathlib import Path
from dflash_assets.generation.servers.sglang_servers import SGLangServers, build_sglang_commands
from dflash_assets.generation.processes.ports import free_port
slow = ["--sim-startup-s", "60", "--sim-speed", "1"]
commands = build_sglang_commands("sim", port_base=free_port(), module="dflash_simulators.sglang_stub",
                                 extra_args=slow, api_key_env="DFLASH_SERVER_API_KEY")
servers = SGLangServers(commands, Path(sys.argv[1]), startup_timeout_s=120)
threading.Thread(target=servers.__enter__, daemon=True).start()
while not servers._key_files:
    time.sleep(0.05)
print(json.dumps({"key_dir": str(servers._key_dir)}), flush=True)
time.sleep(600)
"""


def test_key_files_of_a_launcher_killed_with_sigkill_are_removed_by_the_reaper(tmp_path, monkeypatch):
    registry = tmp_path / "registry"
    env = {
        **os.environ,
        "DFLASH_SERVER_REGISTRY": str(registry),
        "DFLASH_SERVER_API_KEY": SECRET,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    launcher = subprocess.Popen(
        [sys.executable, "-c", KEY_LAUNCHER, str(tmp_path / "logs")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = launcher.stdout.readline()
        key_dir = Path(json.loads(line)["key_dir"])
        assert any(SECRET in p.read_text() for p in key_dir.iterdir())  # the key file SGLang reads
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert key_dir.exists()  # kill -9: no stop(), the key file stays ...
    monkeypatch.setenv("DFLASH_SERVER_REGISTRY", str(registry))
    reap_orphaned_servers(grace_s=5)
    assert not key_dir.exists()  # ... until the reaper runs
    assert list(registry.glob("*")) == []
    assert not any(
        SECRET in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file() and "logs" not in p.parts
    )


def test_a_record_a_killed_launcher_left_under_its_temporary_name_is_still_reaped(tmp_path):
    """The input that showed it (a whole-suite run, 2026-12-03): the launcher above was killed while it registered
    its server, and ``.vm_14908_3367057.json.14905.8d8d21d9.tmp`` stayed in the registry, read by no reaper. A
    whole record of a dead writer is now put in place and acted on; a part of one is removed once abandoned."""
    registry = tmp_path / "registry"
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()  # the launcher, gone
    try:
        path = register_server(server, ["sleep", "600"], None, "left behind", registry)
        entry = {**json.loads(path.read_text()), "owner_pid": writer.pid}
        (registry / f".{path.name}.{writer.pid}.0123abcd.tmp").write_text(json.dumps(entry))  # written, not renamed
        path.unlink()
        old_part = registry / f".other_1_2.json.{writer.pid}.00000000.tmp"
        old_part.write_text('{"pid": 12')
        os.utime(old_part, (time.time() - 120, time.time() - 120))
        young_part = registry / f".young_1_2.json.{writer.pid}.11111111.tmp"  # its writer may be on another host
        young_part.write_text('{"pid"')
        stopped = reap_orphaned_servers(registry, grace_s=5)
        assert [e["pid"] for e in stopped] == [server.pid]
        assert server.wait(timeout=10) == -signal.SIGTERM
        assert sorted(p.name for p in registry.iterdir()) == [young_part.name]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
