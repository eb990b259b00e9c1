"""Requests per second the generation client sustains against an instant fake server.

The fake server (bench/dflash_simulators/stand_in_server.py) runs in its own process so client and server do
not share one Python interpreter. The same-work baseline is ``openai.AsyncOpenAI`` driven by the same number
of workers (same concurrency, same request body, JSON parsed, no retries, journal or accounting); the two are
timed in alternating rounds and the median ratio is printed beside the goal (>= 0.9), with the absolute rate
beside its target (--target req/s). A raw per-worker httpx transport (no JSON, prebuilt body) is printed as
the floor: strictly less work, no goal. Prints one ``name: value`` line per figure.

    python bench/bench_client.py [--requests 5000] [--concurrency 64] [--target 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from headline import headline

from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.client.results import CompletionResult


def _start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_simulators.stand_in_server"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def _server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the server process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(url: str, n: int, concurrency: int, use_uvloop: bool) -> tuple[float, float, int, int]:
    """Returns (wall seconds, client CPU seconds, succeeded, failed)."""
    client = CompletionClient([url], api_key="bench-key", concurrency=concurrency, max_attempts=1)
    ok = failed = 0

    def on_result(result: CompletionResult) -> None:
        nonlocal ok, failed
        if result.error is None:
            ok += 1
        else:
            failed += 1

    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    items = ((i, body) for i in range(n))
    start, cpu = time.perf_counter(), time.process_time()
    if use_uvloop:
        client.generate_blocking(items, on_result)
    else:
        asyncio.run(client.generate(items, on_result))
    return time.perf_counter() - start, time.process_time() - cpu, ok, failed


def _run_openai(url: str, n: int, concurrency: int) -> float:
    """Wall seconds for ``n`` chat completions through ``openai.AsyncOpenAI`` with ``concurrency``
    workers: the plain way (no retries, journal or accounting); the same-work baseline."""
    import openai

    async def go() -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench-key", max_retries=0) as api:
            pending = iter(range(n))

            async def worker() -> None:
                for _ in pending:
                    await api.chat.completions.create(
                        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=16
                    )

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    start = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - start


def _run_floor(url: str, n: int, concurrency: int) -> float:
    """Wall seconds for ``n`` requests over one raw httpx transport per worker with a prebuilt body and
    no JSON decoding: strictly less work than any client (no goal; shows what the client costs)."""
    import httpx

    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).encode()
    target = httpx.URL(f"{url}/v1/chat/completions")

    ssl_context = httpx.create_ssl_context()  # ~25 ms each: once, not once per worker

    async def go() -> None:
        pending = iter(range(n))

        async def worker() -> None:
            async with httpx.AsyncHTTPTransport(verify=ssl_context, retries=0) as transport:
                for _ in pending:
                    request = httpx.Request("POST", target, content=body, headers={"Content-Type": "application/json"})
                    response = await transport.handle_async_request(request)
                    await response.aread()
                    await response.aclose()  # hands the connection back to the pool

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    start = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - start


#: The user's node (../shared/docs/SCALE.md): ~25,000 output tokens/s in all, ~2,600 output tokens a row on average.
NODE_TOKENS_PER_S, NODE_TOKENS_PER_ROW = 25_000, 2_600
#: Where a profiled request's client CPU goes, by the module path that spends it (first match wins).
PROFILE_GROUPS = (
    ("HTTP (httpcore, h11, httpx, anyio)", ("/httpcore/", "/h11/", "/httpx/", "/anyio/", "/sniffio/")),
    ("event loop and sockets (asyncio, ssl, selectors)", ("/asyncio/", "/selectors.py", "/ssl.py", "/socket.py")),
    ("JSON", ("/json/",)),
    ("this project's client (routing, attempts, journal callbacks)", ("/dflash_assets/",)),
    ("retries (tenacity)", ("/tenacity/",)),
)


def profile_client(url: str, n: int, concurrency: int) -> dict[str, float]:
    """Client CPU of ``n`` requests under cProfile, as shares of the profiled total by :data:`PROFILE_GROUPS`
    (own time of each function; C functions apart)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    _run(url, n, concurrency, False)
    profiler.disable()
    stats = pstats.Stats(profiler)
    shares: dict[str, float] = {}
    for (filename, _line, _name), (_cc, _nc, own_s, _cum, _callers) in stats.stats.items():
        group = next((g for g, marks in PROFILE_GROUPS if any(m in filename for m in marks)), "other Python")
        if filename == "~":  # C functions: socket send / recv, isinstance, dict and list methods
            group = "built-in C functions (socket send / recv, isinstance, ...)"
        shares[group] = shares.get(group, 0.0) + own_s
    total = sum(shares.values()) or 1.0
    print("client CPU by where it goes (cProfile, own time):")
    for group, own in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {own / total:6.1%}  {group}")
    stats.sort_stats("tottime").print_stats(12)
    return {g: own / total for g, own in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--target", type=float, default=1000.0, help="req/s the client must sustain")
    parser.add_argument("--rounds", type=int, default=5, help="alternating client / bare-httpx rounds for the ratio")
    args = parser.parse_args()

    try:
        import uvloop  # noqa: F401

        loops = ["asyncio", "uvloop"]
    except ImportError:
        loops = ["asyncio"]
    print(f"requests: {args.requests}")
    print(f"concurrency: {args.concurrency}")
    print(f"target_requests_per_s: {args.target:.0f}")
    print(f"cpu_cores: {os.cpu_count()}")
    print(f"load_average_1min: {os.getloadavg()[0]:.2f}")
    proc, url = _start_server()
    try:
        for loop in loops:
            _run(url, min(500, args.requests), args.concurrency, loop == "uvloop")  # warm-up
            server_cpu = _server_cpu_s(proc.pid)
            wall, cpu, _ok, failed = _run(url, args.requests, args.concurrency, loop == "uvloop")
            server_cpu = _server_cpu_s(proc.pid) - server_cpu
            rate = args.requests / wall
            print(f"[{loop}] failed: {failed}")
            print(f"[{loop}] wall_s: {wall:.3f}")
            print(f"[{loop}] requests_per_s: {rate:.0f}")
            print(f"[{loop}] client_cpu_us_per_request: {cpu / args.requests * 1e6:.0f}")
            print(f"[{loop}] server_cpu_us_per_request: {server_cpu / args.requests * 1e6:.0f}")
            # What one free core would sustain: the client is CPU-bound against an instant server.
            print(f"[{loop}] client_cpu_bound_requests_per_s: {args.requests / cpu:.0f}")
            print(f"[{loop}] meets_target: {'yes' if rate >= args.target and failed == 0 else 'no'}")
        ratios, floors, walls = [], [], []
        for _ in range(args.rounds):
            walls.append(_run(url, args.requests, args.concurrency, False)[0])
            ratios.append(_run_openai(url, args.requests, args.concurrency) / walls[-1])
            floors.append(_run_floor(url, args.requests, args.concurrency) / walls[-1])
        median = statistics.median(ratios)
        print(
            f"client / openai.AsyncOpenAI requests/s ratio (asyncio, median of {args.rounds} alternating rounds): "
            f"{median:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}; goal >= 0.9: "
            f"{'met' if median >= 0.9 else 'NOT met'})"
        )
        print(
            "client / raw per-worker httpx transport floor ratio (strictly less work, no goal): median "
            f"{statistics.median(floors):.3f}"
        )
        rate = args.requests / statistics.median(walls)
        print(
            f"client requests/s (asyncio, median round) {rate:.0f} (goal >= {args.target:.0f} req/s: "
            f"{'met' if rate >= args.target else 'NOT met'})"
        )
        headline(
            f"client / openai.AsyncOpenAI requests/s, same workers, median of {args.rounds} alternating rounds",
            median,
            ">= 0.9",
            median >= 0.9,
        )
        headline(
            "client requests/s against an instant local server (median round)",
            round(rate),
            f">= {args.target:.0f}",
            rate >= args.target,
        )
        headline(
            "client / raw per-worker httpx transport requests/s (strictly less work)",
            statistics.median(floors),
            "none (context: what the client costs)",
        )
        # what bounds it, and what the node asks of it (issue 52: >= 1,000 req/s, or the bound explained)
        shares = profile_client(url, min(2000, args.requests), args.concurrency)
        http = shares.get(PROFILE_GROUPS[0][0], 0.0) + shares.get(PROFILE_GROUPS[1][0], 0.0)
        headline(
            "client CPU in HTTP and the event loop (httpcore, h11, httpx, asyncio; cProfile own time), share",
            round(http, 3),
            "none (context: the bound: one Python thread doing HTTP/1.1; this project's code "
            f"{shares.get(PROFILE_GROUPS[3][0], 0.0):.1%})",
        )
        need = NODE_TOKENS_PER_S / NODE_TOKENS_PER_ROW
        headline(
            f"client requests/s (median round) / requests/s the user's node needs ({NODE_TOKENS_PER_S:,} output "
            f"tok/s / {NODE_TOKENS_PER_ROW:,} tokens a row = {need:.1f} req/s, SCALE.md)",
            round(rate / need, 1),
            ">= 10 (the client on under a tenth of one core at the node's rate)",
            rate / need >= 10,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


if __name__ == "__main__":
    main()
