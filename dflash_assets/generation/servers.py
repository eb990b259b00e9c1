"""Inference-server launchers: ``transformers serve`` on CPU (the embedded default) and SGLang on GPUs.

No Dagster here: ``dflash_assets.resources.inference`` wraps these for the pipeline.

Two launchers, both context managers that start subprocesses in their own process groups, wait until
a *generation* succeeds (a 200 from ``/health`` alone can hide a hung generator) and kill the groups on
exit:

- :class:`LocalTransformersServer`: one ``transformers serve DIR --device cpu --continuous-batching``.
- :class:`SGLangServers`: N ``python -m sglang.launch_server`` processes (one per GPU or TP group) from
  :func:`build_sglang_commands`, or one ``python -m sglang_router.launch_server --dp-size N`` from
  :func:`build_router_command`.

What ``transformers serve`` (transformers 5.24, measured with SmolLM2-135M-Instruct) returns and accepts:

- ``finish_reason`` is ``"length"`` when ``completion_tokens >= max_tokens``, else ``"stop"`` (also
  ``"tool_calls"`` when a tool call is parsed). ``usage.prompt_tokens`` is the length of the
  chat-templated prompt (``add_generation_prompt=True``); ``usage.completion_tokens`` counts the
  generated ids *including* the end-of-turn token (``<|im_end|>``) on a ``stop``. ``message.content`` is
  decoded with ``skip_special_tokens=True``.
- ``chat_template_kwargs`` is accepted and forwarded to ``apply_chat_template`` (SmolLM2's template
  ignores ``enable_thinking``).
- ``message.reasoning_content`` appears only for model types with a response template (the Qwen2/Qwen3
  families); for SmolLM2 (llama) it is absent and all text is in ``content``.
- No generated token ids: ``logprobs``/``top_logprobs`` are accepted and ignored (so are
  ``presence_penalty``, ``n``, ``stream_options`` ...), and no ``return_token_ids`` field exists.
  Callers re-tokenize ``content`` (and add the end-of-turn token on ``stop``).
- Request fields outside the OpenAI schema are rejected with HTTP 422: ``top_k``, ``min_p`` and
  ``repetition_penalty`` among them; only ``seed``, ``chat_template_kwargs`` and ``generation_config``
  (a JSON *string* of ``GenerationConfig`` fields) are extra. :data:`TRANSFORMERS_SERVE_REJECTED_FIELDS`.
- ``model`` must equal the served directory string (:attr:`LocalTransformersServer.model_name`) or be
  omitted; another name gets HTTP 400. ``/v1/models`` lists that string as the id.
- With ``--continuous-batching`` the sampling configuration (``do_sample``, temperature, top_p, top_k)
  is fixed by the *first* request for the server's whole life; later requests only set
  ``max_tokens`` (per request) — their temperature/top_p/seed are ignored. ``temperature`` alone never
  turns sampling on: ``do_sample`` comes from the model's ``generation_config.json`` (absent for
  SmolLM2, so it decodes greedily) or from a ``generation_config`` field. Hence the startup probe,
  which is the first request, carries the sampling the server must use (``settings=``).

Servers outlive a killed launcher unless something stops them, so two layers guard against orphans
(Linux): each server gets :data:`PARENT_DEATH_SIGNAL` when the thread that started it dies
(``PR_SET_PDEATHSIG``, see :func:`_start_process`), and each writes a pidfile into :func:`server_registry_dir` that
:func:`reap_orphaned_servers` uses to stop servers whose launcher is gone (``run`` and the completions
resource call it before starting servers).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import httpx

from dflash_assets.atomic import atomic_write_bytes
from dflash_assets.generation.urls import api_root, chat_completions_url, origin, redact, strip_credentials
from dflash_assets.settings import GenerationSettings, dagster_home

logger = logging.getLogger(__name__)

#: Request fields ``transformers serve`` rejects with HTTP 422 (not in the OpenAI chat schema).
TRANSFORMERS_SERVE_REJECTED_FIELDS = frozenset({"top_k", "min_p", "repetition_penalty"})

#: Tokens per KV-cache block of transformers' continuous batching (ContinuousBatchingConfig.page_size default).
CB_PAGE_SIZE = 256

#: Environment variable that holds the inference servers' API key (its value never goes into logs).
API_KEY_ENV = "DFLASH_SERVER_API_KEY"

Backend = Literal["transformers", "sglang", "openai"]


@dataclass(frozen=True)
class ServerPool:
    """Where the completions client sends requests.

    Attributes:
        base_urls: OpenAI base URLs ending in ``/v1`` (``POST {base_url}/chat/completions``).
        model: the ``model`` value requests must carry.
        api_key: sent as ``Authorization: Bearer <api_key>`` when not None.
        max_running_requests: client concurrency *per base URL* (requests in flight at once).
        backend: which server answers, so the client can drop fields it rejects (:meth:`adapt_body`).
    """

    base_urls: list[str]
    model: str
    api_key: str | None = None
    max_running_requests: int = 16
    backend: Backend = "openai"
    #: what may be done about a faulty server (:mod:`dflash_assets.generation.supervision`); None: nothing
    supervisor: Any = field(default=None, compare=False, repr=False)

    def headers(self) -> dict[str, str]:
        """HTTP headers for every request (the bearer token when an API key is set)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def adapt_body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Return ``body`` minus the fields this backend rejects.

        For ``transformers serve`` that is :data:`TRANSFORMERS_SERVE_REJECTED_FIELDS` (HTTP 422 otherwise);
        its sampling was fixed at startup by the probe (see the module docstring). Others: unchanged copy.
        """
        if self.backend == "transformers":
            return {k: v for k, v in body.items() if k not in TRANSFORMERS_SERVE_REJECTED_FIELDS}
        return dict(body)

    def __repr__(self) -> str:  # keep the key out of logs
        key = "None" if self.api_key is None else "'***'"
        return (
            f"ServerPool(base_urls={self.base_urls!r}, model={self.model!r}, api_key={key}, "
            f"max_running_requests={self.max_running_requests}, backend={self.backend!r})"
        )


# --------------------------------------------------------------------------------------------------
# process and HTTP helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (another process may still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path | str | None, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` bytes of a log file as text ('' when missing)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# orphan protection: parent-death signal and the pidfile registry

#: Environment variable that overrides :func:`server_registry_dir` (tests, several instances per host).
REGISTRY_ENV = "DFLASH_SERVER_REGISTRY"

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

#: Signal a server's leader gets when its launcher dies. SIGKILL, not SIGTERM: on SIGTERM the uvicorn
#: server of ``transformers serve`` shuts down gracefully, first finishing in-flight generations for a
#: client that is dead (measured: 60 s for 16 rows of 128 tokens with SmolLM2; as long as the longest
#: row in general). SGLang's HTTP server is uvicorn too.
PARENT_DEATH_SIGNAL = signal.SIGKILL


def server_registry_dir() -> Path:
    """Directory of the running-server pidfiles: ``$DFLASH_SERVER_REGISTRY``, else
    ``<DAGSTER_HOME>/storage/dflash_servers`` (next to the run storage that ``run`` reaps; git-ignored)."""
    return Path(os.environ.get(REGISTRY_ENV) or dagster_home() / "storage" / "dflash_servers")


class ProcStat(NamedTuple):
    """Fields of ``/proc/<pid>/stat`` (proc(5)): ``state`` (``"Z"`` = zombie), ``ppid``, ``pgrp``,
    ``session`` and ``start_time`` (clock ticks after boot; with the pid it names one process)."""

    state: str
    ppid: int
    pgrp: int
    session: int
    start_time: int


def proc_stat(pid: int) -> ProcStat | None:
    """:class:`ProcStat` of ``pid``; None when there is no such process (or no ``/proc``: not Linux)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # comm may hold spaces and ')': split after the last one
    # fields[0] is field 3 (state); field k is fields[k - 3]
    return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def _boot_id() -> str | None:
    """This boot's id: pids and start times from another boot mean nothing."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _exited(pid: int) -> bool:
    """No thread of process ``pid`` is left but zombies. A killed multi-threaded process shows its
    leader as a zombie while the other threads still tear down (and hold its sockets and memory)."""
    try:
        tids = os.listdir(f"/proc/{int(pid)}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{int(pid)}/task/{tid}/stat", "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        if text[text.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            return False
    return True


def _is_running(pid: int, start_time: int | None) -> bool:
    """``pid`` exists, has not exited (:func:`_exited`) and (when ``start_time`` is known) started at
    ``start_time``."""
    if pid <= 0:
        return False
    stat = proc_stat(pid)
    if stat is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc (not Linux): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return (start_time is None or stat.start_time == start_time) and not _exited(pid)


def _group_members(pgid: int, leader_start_time: int) -> list[int]:
    """Processes of process group ``pgid`` not yet exited (:func:`_exited`) started no earlier than its leader.

    Empty when a process with pid ``pgid`` exists but started at another time: the pid was recycled,
    which the kernel allows only once no process is left in the old group.
    """
    leader = proc_stat(pgid)
    if leader is not None and leader.start_time != leader_start_time:
        return []
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat and stat.pgrp == pgid and stat.start_time >= leader_start_time and not _exited(int(name)):
                members.append(int(name))
    return members


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), resolved in the parent so the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _parent_death_preexec(sig: int = PARENT_DEATH_SIGNAL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when the thread that forked it exits
    (``prctl(PR_SET_PDEATHSIG)``, prctl(2)); None where that does not exist (not Linux)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os._exit(1)

    return preexec


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _on_long_lived_thread(fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run ``fn`` on the main thread or, from any other thread, on one spawner thread kept for the
    process's life: PR_SET_PDEATHSIG fires when the *forking thread* exits, so a server forked by a
    short-lived worker thread would be killed when that thread ended, not when the process did."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-server-spawner")
    return _spawner.submit(fn).result()


def register_server(
    proc: subprocess.Popen, argv: Sequence[str], port: int | None, label: str = "",
    registry_dir: Path | str | None = None,
) -> Path | None:
    """Write the pidfile of a server started in its own session; returns its path (None if it failed).

    JSON fields: ``pid`` (= ``pgid``, the session leader), ``start_time`` (``/proc/<pid>/stat`` field 22,
    clock ticks after boot: a recycled pid never matches), ``boot_id``, ``host``, ``argv0``, ``label``,
    ``port``, ``owner_pid``/``owner_start_time`` (this process) and ``created_at`` (Unix seconds).
    Written atomically (temporary file + rename). A failure is logged, not raised: the server runs
    unprotected rather than not at all.
    """
    stat = proc_stat(proc.pid)
    owner = proc_stat(os.getpid())
    entry = {
        "pid": proc.pid, "pgid": proc.pid, "start_time": stat.start_time if stat else None,
        "boot_id": _boot_id(), "host": socket.gethostname(), "argv0": str(argv[0]) if argv else "",
        "label": label, "port": port, "owner_pid": os.getpid(),
        "owner_start_time": owner.start_time if owner else None, "created_at": time.time(),
    }
    directory = Path(registry_dir) if registry_dir else server_registry_dir()
    path = directory / f"{entry['host']}_{proc.pid}_{entry['start_time']}.json"
    try:
        atomic_write_bytes(path, json.dumps(entry).encode())
    except OSError as exc:
        logger.warning("could not register server pid %s in %s: %s", proc.pid, directory, exc)
        return None
    return path


def reap_orphaned_servers(registry_dir: Path | str | None = None, grace_s: float = 10.0) -> list[dict[str, Any]]:
    """Stop every registered server on this host whose launching process is gone, and drop stale pidfiles.

    A server is stopped when its owner (``owner_pid`` with ``owner_start_time``) is no longer running and
    its process group still holds live processes started no earlier than the recorded leader (a leader
    pid now held by a process with another start time is left alone): ``SIGTERM`` to the group, up to
    ``grace_s`` seconds to exit, then ``SIGKILL``. Pidfiles of dead servers, or from an earlier boot, are
    removed; those of servers whose owner runs, or of other hosts (shared DAGSTER_HOME), are kept.

    Args:
        registry_dir: pidfile directory; None = :func:`server_registry_dir`.
        grace_s: seconds between SIGTERM and SIGKILL.

    Returns:
        The pidfile entries (dicts, see :func:`register_server`) of the servers stopped, each with
        ``killed_pids`` added. Use :func:`orphan_message` to report them.
    """
    directory = Path(registry_dir) if registry_dir else server_registry_dir()
    if not directory.is_dir():
        return []
    host, boot = socket.gethostname(), _boot_id()
    stopped = []
    for path in sorted(directory.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # stopped cleanly, or another reaper got it
        except (OSError, ValueError) as exc:
            logger.warning("unreadable server pidfile %s: %s", path, exc)
            continue
        if entry.get("host") != host:
            continue
        if entry.get("boot_id") != boot:
            path.unlink(missing_ok=True)
            continue
        if _is_running(int(entry.get("owner_pid") or 0), entry.get("owner_start_time")):
            continue
        pgid, start_time = int(entry["pgid"]), entry.get("start_time")
        if start_time is None:  # unverifiable (no /proc at launch): never kill on a pid alone
            continue
        members = _group_members(pgid, start_time)
        if members:
            try:
                os.killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while _group_members(pgid, start_time) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _group_members(pgid, start_time):
                    os.killpg(pgid, signal.SIGKILL)
                    deadline = time.monotonic() + 5.0
                    while _group_members(pgid, start_time) and time.monotonic() < deadline:
                        time.sleep(0.1)
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                logger.warning("cannot stop orphaned server pid %s: %s", pgid, exc)
                continue
            if _group_members(pgid, start_time):
                continue  # still dying (uninterruptible sleep): keep the pidfile for the next reaper
            stopped.append({**entry, "killed_pids": members})
        path.unlink(missing_ok=True)
    return stopped


def orphan_message(entry: Mapping[str, Any]) -> str:
    """One line for a server :func:`reap_orphaned_servers` stopped."""
    label = f" ({entry['label']})" if entry.get("label") else ""
    return (f"stopped orphaned inference server pid {entry['pid']}{label} on port {entry.get('port')} "
            f"left by a killed run (launcher pid {entry.get('owner_pid')})")


def _start_process(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, port: int | None = None, label: str = "",
    parent_death_signal: bool = True, registry_dir: Path | str | None = None,
) -> subprocess.Popen:
    """Start ``argv`` in a new session (own process group) with stdout+stderr appended to ``log_path``,
    and register it (:func:`register_server`; the path is kept as ``proc.registry_file``).

    With ``parent_death_signal`` (Linux) the leader gets :data:`PARENT_DEATH_SIGNAL` when this process
    dies, even by SIGKILL. It reaches the leader only: its children must exit with it (``transformers
    serve`` is one process; SGLang's scheduler/detokenizer set their own PR_SET_PDEATHSIG on the
    launcher), and what remains of the group is stopped by :func:`reap_orphaned_servers`. Non-main callers are forked from
    a process-long spawner thread (:func:`_on_long_lived_thread`).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    preexec = _parent_death_preexec() if parent_death_signal else None

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # preexec only calls the pre-resolved prctl and getppid: nothing that takes a lock another
                # thread could hold at fork time (the reason preexec_fn is flagged unsafe with threads)
                env=dict(env), start_new_session=True, preexec_fn=preexec,  # noqa: PLW1509
            )

    proc = _on_long_lived_thread(spawn) if preexec is not None else spawn()
    proc.registry_file = register_server(proc, argv, port, label, registry_dir)  # type: ignore[attr-defined]
    return proc


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM the process group of ``proc``, wait up to ``grace_s`` seconds, then SIGKILL it.

    The group is signalled even when the leader has already exited, so orphaned workers (SGLang's
    scheduler/detokenizer processes) die too. Removes the pidfile once the leader is reaped.
    Returns the leader's exit code (None if unknown).
    """
    pgid = proc.pid  # start_new_session=True makes the leader's pid the group id
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # leftovers in the group, or a leader that ignored SIGTERM
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    registry_file = getattr(proc, "registry_file", None)
    if registry_file is not None and proc.returncode is not None:
        Path(registry_file).unlink(missing_ok=True)
        proc.registry_file = None  # type: ignore[attr-defined]
    return proc.returncode


def probe_chat(
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one tiny ``/chat/completions`` request (``max_tokens=2``) and return the decoded reply.

    The endpoint follows the client's rule (:func:`~dflash_assets.generation.urls.chat_completions_url`:
    ``base_url`` with or without ``/v1``). Every text from the server is redacted (``api_key``) first.

    Raises:
        httpx.TransportError: the server is not reachable (yet), or did not answer in ``timeout_s`` s.
        RuntimeError: it answered with an HTTP error, a body that is not JSON, or a reply without
            ``choices``; the message names the URL and what to try.
    """
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(extra_body or {})
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = chat_completions_url(base_url)
    shown = strip_credentials(url)
    r = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
    text = redact(r.text, api_key)
    if r.status_code != 200:
        raise RuntimeError(f"probe POST {shown} got HTTP {r.status_code}: {text[:500]}; {_probe_advice(r.status_code, base_url, model)}")
    try:
        reply = r.json()
    except ValueError:
        raise RuntimeError(
            f"probe POST {shown} got a reply that is not JSON: {text[:200]!r}; is {strip_credentials(origin(base_url))} "
            "an OpenAI-compatible server (SGLang, vLLM, transformers serve)? base_urls take http://HOST:PORT or http://HOST:PORT/v1"
        ) from None
    if not isinstance(reply, dict) or not reply.get("choices"):
        raise RuntimeError(f"probe POST {shown} got a reply without choices: {redact(str(reply), api_key)[:500]}; "
                           "is it an OpenAI-compatible chat completions endpoint?")
    return reply


def _probe_advice(status: int, base_url: str, model: str) -> str:
    models = strip_credentials(api_root(base_url) + "/models")
    if status == 404:
        return f"the server has no such route: check base_urls (http://HOST:PORT or http://HOST:PORT/v1; try `curl {models}`)"
    if status in (401, 403):
        return "the server refused the API key: set DFLASH_SERVER_API_KEY to the key the server was started with"
    if status in (400, 422):
        return f"check served_model_name {model!r} against the ids `curl {models}` lists"
    return f"check the server's log; `curl {models}` shows whether it is up"


def probe_external(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """:func:`probe_chat` for a server that should already be up: an unreachable one is a RuntimeError
    naming the URL and what to try (not a bare "Connection refused")."""
    try:
        return probe_chat(base_url, model, api_key, timeout_s=timeout_s)
    except httpx.TransportError as exc:
        shown = strip_credentials(chat_completions_url(base_url))
        raise RuntimeError(
            f"probe POST {shown} failed: {type(exc).__name__}: {redact(str(exc), api_key) or 'no answer'}; is the server "
            f"running and reachable from this host? try `curl {strip_credentials(api_root(base_url))}/models`; base_urls take "
            "http://HOST:PORT or http://HOST:PORT/v1"
        ) from None


def _origin(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (SGLang's health routes are not under /v1)."""
    return origin(base_url)


# --------------------------------------------------------------------------------------------------
# transformers serve (CPU)


def transformers_executable() -> list[str]:
    """argv prefix that runs the ``transformers`` CLI of this interpreter's environment."""
    script = Path(sys.executable).with_name("transformers")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())"]


def transformers_generation_config(model_dir: Path | str, settings: GenerationSettings | None) -> dict[str, Any]:
    """``GenerationConfig`` fields for the startup probe: the model's ``generation_config.json``
    (eos/pad ids) overlaid with ``settings``' sampling (``do_sample = temperature > 0``).

    Empty when ``settings`` is None: the server then keeps the model's own defaults (greedy for SmolLM2).
    """
    if settings is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    config["do_sample"] = settings.temperature > 0
    if settings.temperature > 0:
        config.update(temperature=settings.temperature, top_p=settings.top_p)
        config["top_k"] = max(settings.top_k, 0)  # 0 disables top-k in transformers
        if settings.min_p > 0:
            config["min_p"] = settings.min_p
    if settings.repetition_penalty != 1.0:
        config["repetition_penalty"] = settings.repetition_penalty
    return config


class LocalTransformersServer:
    """``transformers serve <model_dir> --device cpu --continuous-batching`` as a context manager.

    Args:
        model_dir: HF model directory (e.g. :func:`dflash_assets.generation.local_model.ensure_local_model`).
        host: listen address.
        port: listen port; a free one is picked when None.
        log_path: file for the server's stdout+stderr; a temporary file when None.
        extra_args: more ``transformers serve`` flags (e.g. ``("--cb-max-batch-tokens", "512")``).
        settings: sampling the server is frozen with (sent by the startup probe, the first request;
            see the module docstring). None keeps the model's defaults: greedy for SmolLM2.
        kv_cache_tokens: KV-cache capacity in tokens (``--cb-num-blocks`` = ceil(tokens / 256), 256 being
            the default ``page_size``). Left to transformers (None) the CPU cache takes 60 % of free RAM:
            ~10 GB RSS measured on a 24 GB machine, vs ~2.8 GB with 32768 tokens and 2048 batch tokens.
            SmolLM2 fp32 KV is 30 layers x 2 x 3 heads x 64 x 4 B = 46 KB per token.
        max_batch_tokens: tokens per forward step (``--cb-max-batch-tokens``); None = transformers' 8192.
        startup_timeout_s: seconds to wait for the first successful generation.
        env: extra environment variables for the server (the hub is always switched off;
            ``OMP_NUM_THREADS`` defaults to 1, override it here).
        parent_death_signal: kill the server when this process dies (Linux; see :func:`_start_process`).
            Off only to let a server outlive its launcher (tests of :func:`reap_orphaned_servers`).

    Attributes (valid inside ``with``):
        base_url: ``http://HOST:PORT/v1``.
        model_name: the ``model`` value requests must carry: ``str(model_dir)``, the string the server
            was started with (it answers HTTP 400 to any other name).
        startup_s: seconds from process start to the first successful generation.

    Raises (on enter):
        RuntimeError: ``fastapi`` is missing, the server exited, or it answered the probe with an error;
            the message holds the tail of the server log.
        TimeoutError: no successful generation within ``startup_timeout_s``; message holds the log tail.
    """

    def __init__(
        self,
        model_dir: Path | str,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | str | None = None,
        extra_args: Sequence[str] = (),
        settings: GenerationSettings | None = None,
        startup_timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        kv_cache_tokens: int | None = 32768,
        max_batch_tokens: int | None = 2048,
        parent_death_signal: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.parent_death_signal = parent_death_signal
        self.kv_cache_tokens = kv_cache_tokens
        self.max_batch_tokens = max_batch_tokens
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = tuple(extra_args)
        self.settings = settings
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.startup_s: float | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return str(self.model_dir)

    def argv(self) -> list[str]:
        """The full command line (no secrets in it)."""
        sizing = []
        if self.kv_cache_tokens is not None and "--cb-num-blocks" not in self.extra_args:
            sizing += ["--cb-num-blocks", str(-(-self.kv_cache_tokens // CB_PAGE_SIZE))]
        if self.max_batch_tokens is not None and "--cb-max-batch-tokens" not in self.extra_args:
            sizing += ["--cb-max-batch-tokens", str(self.max_batch_tokens)]
        return [
            *transformers_executable(), "serve", str(self.model_dir),
            "--host", self.host, "--port", str(self.port),
            "--device", "cpu", "--continuous-batching", *sizing, *self.extra_args,
        ]

    def pool(self, max_running_requests: int = 16) -> ServerPool:
        """This server as a :class:`ServerPool` (``backend="transformers"``)."""
        return ServerPool([self.base_url], self.model_name, None, max_running_requests, "transformers")

    def __enter__(self) -> LocalTransformersServer:
        if importlib.util.find_spec("fastapi") is None:
            raise RuntimeError(
                "`transformers serve` needs fastapi, which is not installed: pip install 'transformers[serving]'"
            )
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not an HF model directory (no config.json)")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="transformers_serve_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        # One intra-op thread by default: on a 2-core machine shared with the pipeline process, the
        # default (all cores) made generation ~7x slower from oversubscription (measured, bench_completions).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", **self.env}
        started = time.monotonic()
        self._proc = _start_process(self.argv(), env, self.log_path, port=self.port, label="transformers serve",
                                    parent_death_signal=self.parent_death_signal)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        if self._proc is not None:
            stop_process_group(self._proc)
            self._proc = None

    def _wait_ready(self, started: float) -> None:
        generation_config = transformers_generation_config(self.model_dir, self.settings)
        extra = {"generation_config": json.dumps(generation_config)} if generation_config else {}
        deadline = started + self.startup_timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with code {self._proc.returncode} before answering; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"transformers serve at {self.base_url} did not finish a generation within "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                # The first request also builds the continuous batcher (~10 s on 2 cores).
                probe_chat(self.base_url, self.model_name, timeout_s=remaining, extra_body=extra)
                return
            except httpx.TransportError:
                time.sleep(0.5)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nlog {self.log_path}:\n{log_tail(self.log_path)}") from None


# --------------------------------------------------------------------------------------------------
# SGLang (GPU)


@dataclass(frozen=True)
class LaunchCommand:
    """One server process to start: ``argv`` (never holding the API key), env overrides, address.

    Attributes:
        argv: the command line without any secret.
        env: variables set on top of the parent's environment (``CUDA_VISIBLE_DEVICES``).
        host, port: where the server (or router) listens.
        api_key_env: name of the environment variable whose value :meth:`launch_argv` appends as
            ``--api-key`` at launch time; None for no key.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key_env: str | None = None

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def launch_argv(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """argv to execute: :attr:`argv` plus ``--api-key <value of api_key_env>`` when a key is named.

        Raises:
            KeyError: ``api_key_env`` is set but not present (or empty) in ``environ`` (default os.environ).
        """
        argv = list(self.argv)
        if self.api_key_env:
            value = (os.environ if environ is None else environ).get(self.api_key_env)
            if not value:
                raise KeyError(f"environment variable {self.api_key_env} (the server API key) is not set")
            argv += ["--api-key", value]
        return argv

    def redacted(self) -> str:
        """A shell-quoted line for logs: env overrides, argv, and ``--api-key $NAME`` in place of the key."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        if self.api_key_env:
            cmd += f" --api-key ${self.api_key_env}"
        return f"{env} {cmd}".strip()


def _sglang_flags(
    model_path: str,
    max_running_requests: int | None,
    max_mamba_cache_size: int | None,
    mem_fraction_static: float | None,
    context_length: int | None,
    tp_size: int,
    reasoning_parser: str | None,
) -> list[str]:
    """Server flags shared by the per-GPU servers and the router's workers (names from SGLang's ServerArgs)."""
    flags = ["--model-path", str(model_path), "--tp-size", str(tp_size)]
    if max_running_requests is not None:
        flags += ["--max-running-requests", str(max_running_requests)]
    if max_mamba_cache_size is not None:
        flags += ["--max-mamba-cache-size", str(max_mamba_cache_size)]
    if mem_fraction_static is not None:
        flags += ["--mem-fraction-static", str(mem_fraction_static)]
    if context_length is not None:
        flags += ["--context-length", str(context_length)]
    if reasoning_parser:
        flags += ["--reasoning-parser", reasoning_parser]
    return flags


def _gpu_groups(num_servers: int, tp_size: int, gpu_ids: Sequence[int] | None) -> list[list[int]]:
    """Split ``gpu_ids`` (default ``0..num_servers*tp_size-1``) into ``num_servers`` groups of ``tp_size``."""
    if num_servers < 1 or tp_size < 1:
        raise ValueError(f"num_servers ({num_servers}) and tp_size ({tp_size}) must be >= 1")
    ids = list(gpu_ids) if gpu_ids is not None else list(range(num_servers * tp_size))
    if len(ids) != num_servers * tp_size:
        raise ValueError(f"{num_servers} servers x tp_size {tp_size} need {num_servers * tp_size} GPUs, got {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpu_ids has duplicates: {ids}")
    return [ids[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)]


def build_sglang_commands(
    model_path: str,
    num_servers: int = 1,
    gpu_ids: Sequence[int] | None = None,
    port_base: int = 30000,
    host: str = "127.0.0.1",
    max_running_requests: int | None = 40,
    max_mamba_cache_size: int | None = None,
    mem_fraction_static: float | None = None,
    context_length: int | None = None,
    tp_size: int = 1,
    reasoning_parser: str | None = "qwen3",
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    module: str = "sglang.launch_server",
) -> list[LaunchCommand]:
    """One ``python -m sglang.launch_server`` per GPU (or per group of ``tp_size`` GPUs).

    ``module`` replaces ``sglang.launch_server`` (e.g. ``dflash_assets.simulation.sglang_stub``, a
    time-faithful stand-in for benches without GPUs); it must take the same flags.

    Server ``i`` sees only its GPUs through ``CUDA_VISIBLE_DEVICES`` and listens on ``port_base + i``.
    Flags left None are not passed (SGLang's defaults apply). ``api_key_env`` names the environment
    variable that holds the key; the value is added only by :meth:`LaunchCommand.launch_argv`.

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids.
    """
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
    flags = _sglang_flags(model_path, max_running_requests, max_mamba_cache_size, mem_fraction_static,
                          context_length, tp_size, reasoning_parser)
    commands = []
    for i, group in enumerate(groups):
        port = port_base + i
        argv = (python, "-m", module, *flags, "--host", host, "--port", str(port), *extra_args)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, group))}
        commands.append(LaunchCommand(argv, env, host, port, api_key_env))
    return commands


def build_router_command(
    model_path: str,
    num_servers: int = 1,
    gpu_ids: Sequence[int] | None = None,
    port: int = 30000,
    worker_port_base: int = 31000,
    host: str = "127.0.0.1",
    max_running_requests: int | None = 40,
    max_mamba_cache_size: int | None = None,
    mem_fraction_static: float | None = None,
    context_length: int | None = None,
    tp_size: int = 1,
    reasoning_parser: str | None = "qwen3",
    api_key_env: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> LaunchCommand:
    """One ``python -m sglang_router.launch_server --dp-size N``: the router co-launches N workers.

    The router listens on ``host:port``; workers take ports from ``--router-dp-worker-base-port``
    and GPUs ``base_gpu_id = rank * tp_size`` within ``CUDA_VISIBLE_DEVICES`` (all of ``gpu_ids``).
    The same ``--api-key`` reaches the workers (ServerArgs); the router's own key flag differs
    between releases, so add it through ``extra_args`` if needed.

    Raises:
        ValueError: ``gpu_ids`` does not hold exactly ``num_servers * tp_size`` distinct ids.
    """
    groups = _gpu_groups(num_servers, tp_size, gpu_ids)
    flags = _sglang_flags(model_path, max_running_requests, max_mamba_cache_size, mem_fraction_static,
                          context_length, tp_size, reasoning_parser)
    argv = (
        python, "-m", "sglang_router.launch_server", *flags, "--dp-size", str(num_servers),
        "--host", host, "--port", str(port), "--router-dp-worker-base-port", str(worker_port_base), *extra_args,
    )
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for group in groups for g in group)}
    return LaunchCommand(argv, env, host, port, api_key_env)


def _sglang_label(command: LaunchCommand, index: int) -> str:
    """Pidfile label: ``sglang router`` or ``sglang <index>``."""
    return "sglang router" if "sglang_router.launch_server" in command.argv else f"sglang {index}"


class SGLangServers:
    """Start SGLang servers (or a router) from :class:`LaunchCommand` s; wait for ``/health_generate``.

    ``/health_generate`` runs a one-token generation, so a hung scheduler does not pass. Logs go to
    ``log_dir/sglang_<i>.log``; the launch line written at the top of each log is the redacted one.

    Args:
        commands: from :func:`build_sglang_commands` or ``[build_router_command(...)]``.
        log_dir: directory for the logs.
        api_key: the key value; used for ``--api-key`` (via the command's ``api_key_env``) and for the
            health probes. None reads the variable from ``os.environ``.
        startup_timeout_s: seconds to wait for every server (loading a 27B model plus CUDA-graph capture
            takes minutes).
        parent_death_signal: kill each server (launcher process) when this process dies (Linux).

    Attributes (inside ``with``): ``base_urls`` (``http://host:port/v1``, in command order).

    Raises (on enter):
        RuntimeError: a server exited before it was healthy (message holds its log tail).
        TimeoutError: not all healthy within ``startup_timeout_s``.
    """

    def __init__(
        self,
        commands: Sequence[LaunchCommand],
        log_dir: Path | str,
        api_key: str | None = None,
        startup_timeout_s: float = 1800.0,
        health_path: str = "/health_generate",
        parent_death_signal: bool = True,
        health_poll_s: float = 0.2,
    ) -> None:
        self.health_poll_s = health_poll_s
        self._lock = threading.Lock()  # restart (a monitor thread) vs stop (the run's end)
        self._closed = False
        self.commands = list(commands)
        self.parent_death_signal = parent_death_signal
        self.log_dir = Path(log_dir)
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.health_path = health_path
        self._procs: list[subprocess.Popen] = []

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.commands]

    def _environ(self, command: LaunchCommand) -> dict[str, str]:
        environ = dict(os.environ)
        if command.api_key_env and self.api_key:
            environ[command.api_key_env] = self.api_key
        return environ

    def __enter__(self) -> SGLangServers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.commands)):
                self._procs.append(self._launch(i))
            self._wait_healthy(range(len(self.commands)))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, i: int) -> subprocess.Popen:
        command = self.commands[i]
        log_path = self.log_dir / f"sglang_{i}.log"
        with open(log_path, "a") as log:
            log.write(f"# launch: {command.redacted()}\n")
        argv = command.launch_argv(self._environ(command))
        return _start_process(
            argv, {**os.environ, **command.env}, log_path, port=command.port, label=_sglang_label(command, i),
            parent_death_signal=self.parent_death_signal,
        )

    def exit_code(self, i: int) -> int | None:
        """Exit code of server ``i`` when its process has exited (killed, crashed), else None."""
        procs = self._procs
        return procs[i].poll() if i < len(procs) else None

    def restart(self, i: int) -> float:
        """Stop server ``i`` (its whole process group), start it again with the same command and wait
        until it generates. Returns the seconds it took. Safe from any thread (one restart per server
        at a time). Raises as :meth:`__enter__` (RuntimeError, TimeoutError)."""
        started = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("servers are stopping: not restarted")
            stop_process_group(self._procs[i], grace_s=5.0)
            self._procs[i] = self._launch(i)
        self._wait_healthy([i])
        return time.monotonic() - started

    def stop(self) -> None:
        """Terminate every server's process group (SIGTERM, then SIGKILL after 30 s). Idempotent."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            stop_process_group(proc, grace_s=30.0)

    def _wait_healthy(self, indices) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        pending = {i: self.commands[i] for i in indices}
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            for i, command in list(pending.items()):
                procs = self._procs
                if i >= len(procs):
                    raise RuntimeError("servers were stopped while waiting for them")
                proc = procs[i]
                if proc.poll() is not None:
                    log_path = self.log_dir / f"sglang_{i}.log"
                    raise RuntimeError(
                        f"SGLang server {i} ({command.base_url}) exited with code {proc.returncode}; "
                        f"log {log_path}:\n{log_tail(log_path)}"
                    )
                try:
                    r = httpx.get(_origin(command.base_url) + self.health_path, headers=headers, timeout=30)
                    if r.status_code == 200:
                        del pending[i]
                except httpx.TransportError:
                    pass
            if pending and time.monotonic() > deadline:
                urls = [c.base_url for c in pending.values()]
                raise TimeoutError(f"SGLang servers {urls} not healthy after {self.startup_timeout_s:.0f} s; "
                                   f"logs in {self.log_dir}")
            if pending:
                # polling is cheap (one GET per pending server); a long pause is idle GPUs after start-up
                time.sleep(self.health_poll_s)
