"""What the completions client may do about a faulty server in a long run (see ``CompletionClient``).

The client's monitor (event-loop side) takes a dead, hung or unreachable server out and re-sends its
requests to the others; a :class:`Supervisor` (blocking, called from a thread of its own) then tries to
bring the server back:

- :class:`ProcessSupervisor`, servers this run started (``sglang`` and ``vllm`` modes): a server is dead when its
  process exited; it is stopped (whole process group) and started again with the same command, and
  rejoins once healthy (SGLang's ``/health_generate``, vLLM's ``/health``); at most ``max_restarts`` times an hour per
  server, so a server that crashes at every start (bad flag, broken GPU) is left out, its log named, instead of
  being restarted forever.
- :class:`ProbeSupervisor`, servers someone else runs (``external`` mode): nothing to restart; the
  server is left out (with a warning) and re-probed with a tiny generation every ``retry_every_s``
  seconds, rejoining when it answers: a run lasting days outlives a server's reboot.

No Dagster here.
"""

from __future__ import annotations

import time
from typing import Protocol

from dflash_assets.generation.servers.group import ServerGroup
from dflash_assets.generation.servers.probe import probe_chat


class Supervisor(Protocol):
    """Interface the client uses (``i`` is the server's position in the client's ``base_urls``)."""

    can_restart: bool
    retry_every_s: float

    def exit_reason(self, i: int) -> str | None:
        """Why server ``i`` is gone (its process exited), or None. Must be quick (called every second)."""

    def recover(self, i: int) -> bool:
        """Bring server ``i`` back (blocking); True when it generates again. May raise (reported)."""


class ProcessSupervisor:
    """Restarts servers of an entered :class:`~dflash_assets.generation.servers.group.ServerGroup` (SGLang's or
    vLLM's; one URL per server, SGLang's router mode excluded), each at most ``max_restarts`` times in any ``window_s``
    seconds."""

    can_restart = True

    def __init__(
        self, servers: ServerGroup, retry_every_s: float = 30.0, max_restarts: int = 5, window_s: float = 3600.0
    ) -> None:
        self.servers = servers
        self.retry_every_s = retry_every_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self.restarts = 0
        self._started: dict[int, list[float]] = {}  # server -> monotonic times of its restarts in the window

    def exit_reason(self, i: int) -> str | None:
        code = self.servers.exit_code(i)
        return None if code is None else f"process exited with code {code}"

    def recover(self, i: int) -> bool:
        """Restart server ``i``. Raises RuntimeError, naming the server's log, when it was already restarted
        ``max_restarts`` times in the last ``window_s`` seconds (it is then left out; the other servers go on)."""
        now = time.monotonic()
        recent = [t for t in self._started.get(i, []) if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            raise RuntimeError(
                f"not restarted: see its log {self.servers.log_path(i)}; server {i} was restarted {len(recent)} times "
                f"in {self.window_s / 60:.0f} min (inference.max_server_restarts {self.max_restarts}) and keeps failing"
            )
        self._started[i] = [*recent, now]
        self.servers.restart(i)
        self.restarts += 1
        return True


class ProbeSupervisor:
    """Re-probes servers it cannot restart (``external`` mode) with a 2-token generation."""

    can_restart = False

    def __init__(
        self,
        base_urls: list[str],
        model: str,
        api_key: str | None = None,
        retry_every_s: float = 30.0,
        probe_timeout_s: float = 60.0,
    ) -> None:
        self.base_urls, self.model, self._api_key = list(base_urls), model, api_key
        self.retry_every_s, self.probe_timeout_s = retry_every_s, probe_timeout_s

    def exit_reason(self, i: int) -> str | None:
        return None  # not our process: faults show in requests (errors, stalls)

    def recover(self, i: int) -> bool:
        try:
            probe_chat(self.base_urls[i], self.model, self._api_key, timeout_s=self.probe_timeout_s)
        except Exception:
            return False
        return True
