"""The completion client's servers: routing state per base URL, the choice of server for an attempt, and
faults (a server dead, hung or unreachable is taken out, its requests re-sent, and it is recovered)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from typing import Any

import httpx

from dflash_assets.generation.api.urls import chat_completions_url, strip_credentials


class Route(str):
    """The label of the server a conversation's requests go to (:meth:`ServerRouting.route_server`): preferred up
    to :attr:`share_factor` times a server's share of the client's slots (the server queues what it cannot run at
    once), where a follow-up's preferred server is taken only below its share."""

    share_factor = 2


class ServerState:
    """Routing state of one base URL."""

    __slots__ = (
        "avoid_until",
        "down_reason",
        "endpoint",
        "in_flight",
        "index",
        "label",
        "last_progress",
        "recent_faults",
        "recovering",
        "retry_at",
        "tasks",
        "url",
    )

    def __init__(self, base_url: str, index: int = 0) -> None:
        self.index = index
        self.down_reason: str | None = None  # set while taken out (dead, hung, unreachable)
        self.recovering = False
        self.retry_at = 0.0
        self.last_progress = time.monotonic()  # last finished request, or when it became busy
        self.tasks: set[asyncio.Future] = set()  # HTTP exchanges in flight (cancelled when taken out)
        self.label = strip_credentials(base_url.rstrip("/"))
        self.endpoint = chat_completions_url(base_url)  # the probe's rule too
        self.url = httpx.URL(self.endpoint)  # parsed once, not per request
        self.in_flight = 0
        self.avoid_until = 0.0
        self.recent_faults = 0


class ServerRouting:
    """Part of :class:`~dflash_assets.generation.client.completion_client.CompletionClient` (split out by concern):
    routing attempts to servers and taking faulty ones out. Uses the client's settings and state (``_servers``,
    ``concurrency``, ``backoff_*``, ``supervisor``, ``stall_timeout_s``, ``faults``, ``_log``...)."""

    def route_server(self, route: str) -> Route:
        """The label of the server requests of ``route`` (a conversation id) prefer: a stable hash of it modulo
        the servers, the same in every run over the same servers (Python's ``hash`` of a string is not)."""
        digest = hashlib.blake2b(route.encode("utf-8"), digest_size=8).digest()
        return Route(self._servers[int.from_bytes(digest, "big") % len(self._servers)].label)

    def _pick_server(self, prefer: str | None = None) -> ServerState:
        """Least in-flight server among those not being avoided; ties rotate. ``prefer`` (a label): that
        server when it is up, not avoided, and below its share of ``concurrency`` (a :class:`Route`: below
        ``Route.share_factor`` times it)."""
        now = time.monotonic()
        up = [s for s in self._servers if s.down_reason is None] or self._servers
        candidates = [s for s in up if s.avoid_until <= now]
        if prefer is not None:
            share = max(1, self.concurrency // len(self._servers)) * getattr(prefer, "share_factor", 1)
            chosen = next(
                (s for s in candidates if s.label == prefer and s.down_reason is None and s.in_flight < share), None
            )
            if chosen is not None:
                return chosen
        if not candidates:  # every server recently failed: take the one that comes back first
            return min(up, key=lambda s: (s.avoid_until, s.in_flight))
        if len(candidates) == 1:
            return candidates[0]
        offset = next(self._rr) % len(candidates)
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda s: s.in_flight)

    def _note_fault(self, server: ServerState) -> None:
        server.recent_faults += 1
        pause = min(self.backoff_max_s, self.backoff_base_s * 2 ** (server.recent_faults - 1))
        server.avoid_until = time.monotonic() + pause

    def _fault_reason(self, server: ServerState, now: float) -> str | None:
        if self.supervisor is not None:
            reason = self.supervisor.exit_reason(server.index)
            if reason:
                return reason
        if self.stall_timeout_s and server.in_flight > 0 and now - server.last_progress > self.stall_timeout_s:
            return (
                f"hung: no request finished for {now - server.last_progress:.0f} s with {server.in_flight} "
                f"in flight (stall_timeout_s {self.stall_timeout_s:g})"
            )
        if self.supervisor is not None and server.recent_faults >= self.down_after_faults:
            return f"unreachable: {server.recent_faults} connection errors / 5xx in a row"
        return None

    def _take_out(self, server: ServerState, reason: str) -> None:
        server.down_reason = reason
        fault = {
            "server": server.label,
            "fault": reason,
            "at_s": round(time.monotonic() - self._start, 2),
            "in_flight": server.in_flight,
            "action": "taken out",
        }
        self.faults.append(fault)
        self._log.warning(
            "server %s taken out: %s; its %d requests in flight go to the other servers",
            server.label,
            reason,
            server.in_flight,
        )
        for task in list(server.tasks):
            task.cancel()
        if self.supervisor is not None:
            self._start_recovery(server, fault)

    def _start_recovery(self, server: ServerState, fault: dict[str, Any]) -> None:
        """Run ``supervisor.recover(i)`` (blocking: a restart takes a server start-up) on a daemon thread,
        so the event loop keeps serving the other servers and a finished run does not wait for it."""
        server.recovering = True
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def done(ok: bool, error: str | None) -> None:
            server.recovering = False
            if ok:
                server.down_reason, server.recent_faults, server.avoid_until = None, 0, 0.0
                server.last_progress = time.monotonic()
                verb = "restarted" if getattr(self.supervisor, "can_restart", False) else "answering again"
                fault["action"] = f"{verb} after {time.monotonic() - started:.1f} s"
                self._log.warning("server %s %s", server.label, fault["action"])
            else:
                server.retry_at = time.monotonic() + getattr(self.supervisor, "retry_every_s", 30.0)
                fault["action"] = "left out" + (f" ({error})" if error else "")
                self._log.warning("server %s left out: %s", server.label, error or "it does not answer")

        def run() -> None:
            try:
                ok, error = bool(self.supervisor.recover(server.index)), None
            except Exception as exc:
                ok, error = False, self._redact(f"{type(exc).__name__}: {exc}")[:300]
            with contextlib.suppress(RuntimeError):  # loop closed: the run is over
                loop.call_soon_threadsafe(done, ok, error)

        threading.Thread(target=run, name=f"dflash-recover-{server.index}", daemon=True).start()

    async def _monitor(self) -> None:
        """Take out dead / hung / unreachable servers; retry left-out ones every ``retry_every_s``."""
        while True:
            await asyncio.sleep(self.monitor_interval_s)
            now = time.monotonic()
            for server in self._servers:
                if server.down_reason is None:
                    reason = self._fault_reason(server, now)
                    if reason:
                        self._take_out(server, reason)
                elif self.supervisor is not None and not server.recovering and now >= server.retry_at:
                    last = next((f for f in reversed(self.faults) if f["server"] == server.label), {})
                    self._start_recovery(server, last)
