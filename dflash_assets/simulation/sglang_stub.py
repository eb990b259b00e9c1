"""A stand-in for ``python -m sglang.launch_server`` that behaves in *time* like one GPU server.

Run it exactly where SGLang would run (``inference.launch_module: dflash_assets.simulation.sglang_stub``):
it takes SGLang's flags (``--model-path --host --port --max-running-requests --api-key``; others are
accepted and ignored) plus its own ``--sim-*`` flags (pass them through ``inference.extra_args``).

What it simulates, all in *simulated seconds* divided by ``--sim-speed`` to get real seconds:

- start-up (``--sim-startup-s``, default 180 s: weights + CUDA-graph capture): the port opens only then;
- ``--max-running-requests`` slots decoding at ``--sim-decode-tok-per-s`` each (default 87.5 tok/s:
  3,500 tok/s per GPU over 40 slots); requests beyond the slots wait in a FIFO queue, as in SGLang;
- output lengths from a lognormal (median ``--sim-median-tokens`` 1,970, sigma ``--sim-sigma`` 0.8: ~18%
  above 4,096, ~4% above 8,192), drawn from a hash of the request's messages, so one prompt has one
  length whatever the cap (a cap raise regenerates consistently and only the cut rows grow);
- the reply of an SGLang server with ``--reasoning-parser``: ``message.reasoning_content`` (first 90% of
  the tokens) and ``message.content`` (the rest; None when the cap cuts inside the thinking),
  ``finish_reason`` ``length`` when the drawn length exceeds ``max_tokens`` (``completion_tokens`` =
  the cap), else ``stop``; ``usage.prompt_tokens``/``completion_tokens``;
- SGLang's ``continue_final_message``: a final assistant message is a prefix the model already wrote; it
  is left out of the length draw (so the sequence keeps its one length), its tokens (words) count as
  done, and only the rest is generated, under ``max_tokens``. With ``separate_reasoning: false`` the reply
  is the raw text (``</think>`` where the thinking closes) in ``message.content``;
- routes ``POST /v1/chat/completions``, ``GET /v1/models``, ``/health``, ``/health_generate``.

Faults on demand: ``--sim-ignore-continue`` answers continuations afresh (an SGLang before 0.4.4); SIGUSR1 makes it hang (``/health`` keeps answering 200, no request finishes, and
``/health_generate`` never answers, as with a stuck scheduler); ``--sim-hang-after N`` does the same after
N finished requests; kill -9 is a dead server.

Bookkeeping for benches: every start appends one line to ``--sim-starts-file``; every request arrival
and finish appends one JSON line to ``--sim-request-log`` (``{"ev": "recv"|"done", "key", "max_tokens",
"tokens", "t"}``, plus ``continued_from`` (prefix tokens) and ``prefix_head`` (its first characters) on ``recv``; ``key`` = the last user message, which the benches make the prompt's id).

Stdlib only (asyncio streams, HTTP/1.1 keep-alive with Content-Length bodies).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import signal
import sys
import time
from statistics import NormalDist
from typing import Any

from dflash_assets.simulation.http11 import read_request

REASONING_SHARE = 0.9  # tokens of thinking before the answer starts
_NORMAL = NormalDist()


def process_start_time() -> float:
    """Unix time this process started (``/proc/self/stat`` field 22 + boot time), else now. The simulated
    start-up counts from here, so the interpreter's own start (slow on a loaded machine) is inside it."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def drawn_length(messages: Any, median: float, sigma: float, seed: str = "") -> int:
    """Output tokens the simulated model wants for ``messages``: a lognormal draw keyed by their hash.

    ``exp(ln(median) + sigma * z)`` with ``z`` the standard-normal quantile of a uniform taken from
    sha256(seed + messages JSON); at least 1 token.
    """
    digest = hashlib.sha256((seed + json.dumps(messages, sort_keys=True)).encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
    return max(1, round(math.exp(math.log(median) + sigma * _NORMAL.inv_cdf(u))))


def reply_fields(length: int, max_tokens: int, done: int = 0, raw: bool = False) -> dict[str, Any]:
    """finish_reason, completion_tokens, reasoning_content and content of a request wanting ``length``
    tokens in all, ``done`` of them already written (a continued prefix), under cap ``max_tokens`` on the
    new ones. Text is two bytes per token: ``"t "`` while thinking, ``"a "`` after. ``raw``: no reasoning
    parser: the text as generated, ``<think>`` / ``</think>`` included, in ``content``."""
    n = max(0, min(length - done, max_tokens))
    think = max(1, round(length * REASONING_SHARE))
    start, end = done, done + n
    thinking, answering = max(0, min(end, think) - start), max(0, end - max(start, think))
    fields = {"finish_reason": "length" if length - done > max_tokens else "stop", "completion_tokens": n}
    if raw:
        opened = "<think>\n" if start == 0 else ""
        closed = "</think>\n\n" if start <= think < end or (start < think and end == think and fields["finish_reason"] == "stop") else ""
        return {**fields, "reasoning_content": None, "content": opened + "t " * thinking + closed + "a " * answering}
    return {**fields, "reasoning_content": "t " * thinking, "content": "a " * answering if answering else None}


class Simulator:
    """State of one simulated server: slots, clock scaling, hang switch, logs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.speed = args.sim_speed
        self.slots = asyncio.Semaphore(args.max_running_requests)
        self.ready = False
        self.hung = asyncio.Event()
        self.finished = 0
        self._request_log = open(args.sim_request_log, "a", buffering=1) if args.sim_request_log else None

    def real(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed

    def log_request(self, **fields: Any) -> None:
        if self._request_log is not None:
            self._request_log.write(json.dumps({**fields, "port": self.args.port, "t": time.time()}) + "\n")

    def hang(self) -> None:
        if not self.hung.is_set():
            print(f"sglang_stub {self.args.port}: hanging (no request will finish)", flush=True)
        self.hung.set()

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 1 << 30
        done, prefix = 0, None
        if self.args.sim_ignore_continue and messages and messages[-1].get("role") == "assistant":
            # SGLang < 0.4.4 knew no continue_final_message: the prefix is just more conversation
            messages = [*messages[:-1], {"role": "user", "content": str(messages[-1].get("content") or "")}]
        elif body.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
            prefix, messages = str(messages[-1].get("content") or ""), messages[:-1]
            done = sum(word in ("t", "a") for word in prefix.split())  # the prefix's tokens
        length = drawn_length(messages, self.args.sim_median_tokens, self.args.sim_sigma, self.args.sim_seed)
        key = next((m.get("content") for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), "")
        self.log_request(ev="recv", key=key, max_tokens=max_tokens, continued_from=done,
                         prefix_head=None if prefix is None else prefix[:12])
        fields = reply_fields(length, int(max_tokens), done, raw=body.get("separate_reasoning") is False)
        async with self.slots:
            if self.hung.is_set():
                await asyncio.Event().wait()
            # decoding: the slot is held for completion_tokens / per-slot rate (simulated seconds)
            done = asyncio.ensure_future(asyncio.sleep(self.real(fields["completion_tokens"] / self.args.sim_decode_tok_per_s)))
            hang = asyncio.ensure_future(self.hung.wait())
            await asyncio.wait({done, hang}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                done.cancel()
                await asyncio.Event().wait()  # hung: never finishes
            hang.cancel()
        self.finished += 1
        if self.args.sim_hang_after and self.finished >= self.args.sim_hang_after:
            self.hang()
        self.log_request(ev="done", key=key, max_tokens=max_tokens, tokens=fields["completion_tokens"])
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict)) + 5
        return {
            "id": f"sim-{self.finished}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.args.model_path,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": fields["content"], "reasoning_content": fields["reasoning_content"]},
                "finish_reason": fields["finish_reason"],
            }],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": fields["completion_tokens"],
                "total_tokens": prompt_tokens + fields["completion_tokens"],
            },
        }

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        path = path.split("?", 1)[0]
        if self.args.api_key and headers.get("authorization") != f"Bearer {self.args.api_key}" and path.startswith("/v1"):
            return 401, {"error": {"message": "Invalid API key"}}
        if path == "/health":
            return 200, {}
        if path == "/health_generate":
            if self.hung.is_set():
                await asyncio.Event().wait()
            await asyncio.sleep(self.real(1 / self.args.sim_decode_tok_per_s))
            return 200, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.args.model_path, "object": "model"}]}
        if path == "/v1/chat/completions" and method == "POST":
            try:
                data = json.loads(body or b"{}")
            except ValueError:
                return 400, {"error": {"message": "body is not JSON"}}
            return 200, await self.generate(data)
        return 404, {"detail": "Not Found"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    return
                headers = {name.lower(): value for name, value in request.headers}
                status, payload = await self.route(request.method, request.target, headers, request.body)
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode() + data
                )
                await writer.drain()
                if request.wants_close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="simulated-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=40)
    p.add_argument("--api-key", default=None)
    p.add_argument("--sim-startup-s", type=float, default=180.0, help="simulated seconds until the port opens")
    p.add_argument("--sim-decode-tok-per-s", type=float, default=87.5, help="decode rate of one slot, simulated tok/s")
    p.add_argument("--sim-speed", type=float, default=1.0, help="simulated seconds per real second")
    p.add_argument("--sim-median-tokens", type=float, default=1970.0)
    p.add_argument("--sim-sigma", type=float, default=0.8)
    p.add_argument("--sim-seed", default="")
    p.add_argument("--sim-starts-file", default=None, help="append one line per start")
    p.add_argument("--sim-request-log", default=None, help="append one JSON line per request arrival and finish")
    p.add_argument("--sim-hang-after", type=int, default=0, help="hang after this many finished requests (0: never)")
    p.add_argument("--sim-ignore-continue", action="store_true",
                   help="ignore continue_final_message (as SGLang < 0.4.4): answer afresh")
    args, _unknown = p.parse_known_args(argv)  # SGLang flags we do not model (--tp-size, --reasoning-parser ...)
    if args.sim_speed <= 0 or args.sim_decode_tok_per_s <= 0 or args.max_running_requests < 1:
        p.error("--sim-speed, --sim-decode-tok-per-s and --max-running-requests must be positive")
    return args


async def serve(args: argparse.Namespace) -> None:
    sim = Simulator(args)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, sim.hang)
    born = process_start_time()
    if args.sim_starts_file:
        with open(args.sim_starts_file, "a") as f:
            f.write(f"{born:.3f} pid={os.getpid()} port={args.port}\n")
    # SGLang logs its whole ServerArgs, API key included, at start-up; so does the stand-in
    print(f"server_args={args!r}", flush=True)
    print(f"sglang_stub {args.port}: starting (pid {os.getpid()}, {args.sim_startup_s:g} simulated s start-up, "
          f"speed x{args.sim_speed:g}, {args.max_running_requests} slots)", flush=True)
    await asyncio.sleep(max(0.0, born + sim.real(args.sim_startup_s) - time.time()))
    server = await asyncio.start_server(sim.handle, args.host, args.port, reuse_address=True, backlog=4096)
    sim.ready = True
    print(f"sglang_stub {args.port}: ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
