"""Requests per second the generation client sustains against an instant fake server.

The fake server (dflash_assets/simulation/stand_in_server.py) runs in its own process so client and server do
not share one Python interpreter. Prints one ``name: value`` line per figure.

    python bench/bench_client.py [--requests 5000] [--concurrency 64] [--target 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_assets.generation.client import CompletionClient, CompletionResult  # noqa: E402


def _start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_assets.simulation.stand_in_server"],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--target", type=float, default=1000.0, help="req/s the client must sustain")
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
            wall, cpu, ok, failed = _run(url, args.requests, args.concurrency, loop == "uvloop")
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
    finally:
        proc.terminate()
        proc.wait(5)


if __name__ == "__main__":
    main()
