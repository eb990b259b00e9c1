"""On-policy tool calls run in a child process the run can abandon, bounded in time and result size (no Dagster).

A model's call is executed by the task's own service objects (:class:`~dflash_assets.data.bfcl.ToolEnvironment`),
and one of them will compute whatever it is asked: ``power(base=3, exponent=1000000000)`` (92 bytes from the
model) ran for ten minutes inline on the client's event-loop thread, GIL held, request timeouts and the stall watch
stopped with it. A thread cannot be stopped, and the GIL it holds stops the others; so the calls go to one child
process (``python -m dflash_assets.data.tool_sandbox``, a JSON line per request and per reply, every string ASCII
escaped), which holds the environment of every conversation of the run:

- a call not answered within ``timeout_s`` kills the child (its whole session); the call's result is an error
  result saying so, and the next call starts a new child, into which each conversation's calls so far are replayed
  before its next one (the timed-out call left out: its effects are gone with the child), so state carries on as
  if that call had not run;
- a result over ``max_result_bytes`` (UTF-8) or not valid Unicode (a lone surrogate a tool echoed from its
  arguments) is replaced by an error result naming why: it is what the model sees next, and it is stored;
- the child sets its address-space limit to ``max_memory_bytes`` where the system allows it (a call that runs out
  of memory raises ``MemoryError`` there: an error result too).

Why a subprocess and not ``multiprocessing``: a Celery worker's pool process (where a cluster runs this) may not
start ``multiprocessing`` children, and its spawn context re-imports the parent's main module (the Dagster or Celery
command) in the child; the protocol here is a dozen lines of JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from typing import Any

from dflash_assets.data.bfcl import BfclTask

__all__ = ["DEFAULT_MAX_RESULT_BYTES", "DEFAULT_TIMEOUT_S", "SandboxedEnvironment", "ToolSandbox", "checked_result"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_RESULT_BYTES = 64 * 1024
DEFAULT_MAX_MEMORY_BYTES = 4 << 30


def _error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


def checked_result(name: str | None, text: Any, max_bytes: int) -> str:
    """``text`` (a tool's result) as it may be sent and stored, else an error result naming why: not text, not
    valid Unicode (a lone surrogate), or over ``max_bytes`` bytes of UTF-8. Never raises."""
    if not isinstance(text, str):
        return _error(f"{name} returned no text")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.start + 1].encode("unicode_escape").decode()
        return _error(f"the result of {name} holds a lone surrogate ({bad}), not valid Unicode: not sent")
    if size > max_bytes:
        return _error(f"the result of {name} is {size:,} bytes, over the {max_bytes:,} a tool result may be: not sent")
    return text


class ToolSandbox:
    """The child process executing every conversation's tool calls (see the module docstring). Thread-safe: one
    call at a time. Use as a context manager, or :meth:`close` it.

    Args:
        timeout_s: seconds a call may take (> 0).
        max_result_bytes: the largest result sent back, UTF-8 bytes (> 0).
        max_memory_bytes: the child's address-space limit (RLIMIT_AS; 0: none).
    """

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ) -> None:
        if not timeout_s > 0 or max_result_bytes < 1:
            raise ValueError(f"timeout_s must be > 0 and max_result_bytes >= 1: {timeout_s}, {max_result_bytes}")
        self.timeout_s, self.max_result_bytes, self.max_memory_bytes = timeout_s, max_result_bytes, max_memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._generation = 0  # bumped at each new child: environments must be loaded into it again
        self._loaded: dict[str, int] = {}
        self._history: dict[str, list[tuple[str, Any]]] = {}
        self._tasks: dict[str, BfclTask] = {}
        self.timeouts = 0  # calls stopped at the time bound (the run's log says how many)

    def __enter__(self) -> ToolSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def environment(self, key: str, task: BfclTask) -> SandboxedEnvironment:
        """A new environment of ``task`` for one conversation, ``key`` unique in this sandbox."""
        with self._lock:
            self._tasks[key], self._history[key] = task, []
            self._loaded.pop(key, None)
        return SandboxedEnvironment(self, key)

    def forget(self, key: str) -> None:
        """Drop a conversation's environment (here and in the child)."""
        with self._lock:
            self._tasks.pop(key, None)
            self._history.pop(key, None)
            if self._loaded.pop(key, None) == self._generation and self._proc is not None:
                with suppress(OSError, TimeoutError, RuntimeError):
                    self._ask({"op": "forget", "key": key}, self.timeout_s)

    def call(self, key: str, name: str | None, arguments: Any) -> str:
        """Execute one call of conversation ``key`` (as :meth:`ToolEnvironment.call`), within ``timeout_s``;
        the result checked by :func:`checked_result`. Never raises but for a key never opened (KeyError)."""
        with self._lock:
            task = self._tasks[key]
            try:
                self._ensure_loaded(key, task)
                reply = self._ask({"op": "call", "key": key, "name": name, "arguments": arguments}, self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                self._kill()
                return _error(f"{name} did not return within {self.timeout_s:g} s: stopped (its effects undone)")
            except (OSError, RuntimeError, ValueError) as exc:  # the child died (out of memory, say)
                self._kill()
                return _error(f"{name} could not be executed: {exc}")
            self._history[key].append((name, arguments))
            return checked_result(name, reply.get("result"), self.max_result_bytes)

    def close(self) -> None:
        """Stop the child (if any)."""
        with self._lock:
            self._kill()

    # -- the child -------------------------------------------------------------------------------------------

    def _ensure_loaded(self, key: str, task: BfclTask) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if self._loaded.get(key) == self._generation:
            return
        history = self._history[key]
        request = {"op": "open", "key": key, "task": dataclasses.asdict(task), "history": history}
        self._ask(request, self.timeout_s * (1 + len(history)))
        self._loaded[key] = self._generation

    def _start(self) -> None:
        self._kill()
        argv = [sys.executable, "-m", "dflash_assets.data.tool_sandbox", str(self.max_memory_bytes)]
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # killed whole at a time-out
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._buffer = b""
        self._generation += 1

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            with suppress(OSError):
                stream.close()

    def _ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request, read its reply line within ``timeout_s``.

        Raises:
            TimeoutError: no reply in time. RuntimeError: the child ended or replied with an error.
        """
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise RuntimeError("the tool process is not running")
        proc.stdin.write(json.dumps(request).encode("ascii") + b"\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the tool process ended (exit {proc.poll()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply = json.loads(line)
        if "fault" in reply:
            raise RuntimeError(reply["fault"])
        return reply


class SandboxedEnvironment:
    """One conversation's environment in a :class:`ToolSandbox`: ``call(name, arguments) -> str`` as
    :meth:`~dflash_assets.data.bfcl.ToolEnvironment.call`, bounded."""

    def __init__(self, sandbox: ToolSandbox, key: str) -> None:
        self.sandbox, self.key = sandbox, key

    def call(self, name: str | None, arguments: Any) -> str:
        return self.sandbox.call(self.key, name, arguments)


def _serve(max_memory_bytes: int) -> None:
    """The child's loop: requests on stdin, one reply line each on stdout (ASCII JSON)."""
    if max_memory_bytes > 0:
        with suppress(ImportError, ValueError, OSError):
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    from dflash_assets.data.bfcl import ToolEnvironment

    environments: dict[str, ToolEnvironment] = {}
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            op, key = request["op"], request["key"]
            if op == "open":
                env = ToolEnvironment(BfclTask(**request["task"]))
                for name, arguments in request["history"]:
                    env.call(name, arguments)
                environments[key] = env
                reply: dict[str, Any] = {"ok": True}
            elif op == "forget":
                environments.pop(key, None)
                reply = {"ok": True}
            else:
                reply = {"result": environments[key].call(request["name"], request["arguments"])}
            data = json.dumps(reply)  # ASCII: a lone surrogate travels as its escape
        except BaseException as exc:  # the child answers every request
            data = json.dumps({"fault": f"{type(exc).__name__}: {str(exc)[:500]}"})
        out.write(data.encode("ascii") + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
