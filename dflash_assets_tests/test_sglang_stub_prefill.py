"""The GPU-server simulator (``dflash_simulators.sglang_stub``) charges prefill time: a cold
continuation pays for its re-sent prefix, one the radix cache still holds does not, decodes stall while
another request's prefill runs, and the cache evicts least-recently-used sequences when its pool is full.

Each test runs the simulator as its own process and talks HTTP to it. Every request's length is fixed by
the flags (``--sim-sigma 0`` with a huge median: the model always wants more than ``max_tokens``), so
the expected times and token counts follow from the flags alone. Time bounds: a simulated sleep is never
shorter than asked (hard lower bounds); upper bounds leave 0.35 s real for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dflash_assets.generation.processes.ports import free_port_block

STUB = "dflash_simulators.sglang_stub"
SPEED = 10.0  # simulated seconds per real second
PREFILL = 1000.0  # --sim-prefill-tok-per-s: 1,000 tokens = 0.1 s real
PROMPT_TOKENS = 1 + 5  # a one-word user message: its words + the 5 template tokens the stub counts
SLACK = 0.35  # real seconds of scheduling noise allowed above an expected time
EARLY = 0.98  # a timer may fire a hair early; nothing in the model can make a request faster


def real(sim_seconds: float) -> float:
    return sim_seconds / SPEED


class Stub:
    """One simulator process, its base URL and its request log."""

    def __init__(self, log: Path, *extra: str) -> None:
        self.log = log
        self.port = free_port_block(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                STUB,
                "--port",
                str(self.port),
                "--sim-startup-s",
                "0",
                "--sim-speed",
                str(SPEED),
                "--sim-median-tokens",
                "1000000",
                "--sim-sigma",
                "0",
                "--max-running-requests",
                "4",
                "--sim-request-log",
                str(log),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"stub on port {self.port} did not start")

    def ask(self, key: str, max_tokens: int, prefix: str | None = None, timeout: float = 30) -> tuple[float, dict]:
        """POST one chat completion (a continuation of ``prefix`` when given); returns (real seconds, reply)."""
        messages = [{"role": "user", "content": key}]
        body: dict = {"model": "simulated-model", "messages": messages, "max_tokens": max_tokens}
        if prefix is not None:
            body.update(messages=[*messages, {"role": "assistant", "content": prefix}], continue_final_message=True)
        start = time.monotonic()
        response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout)
        response.raise_for_status()
        return time.monotonic() - start, response.json()

    def events(self, ev: str, key: str) -> list[dict]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [e for e in map(json.loads, lines) if e["ev"] == ev and e["key"] == key]


@pytest.fixture
def stubs(tmp_path):
    started: list[Stub] = []

    def start(*flag_sets: tuple[str, ...]) -> list[Stub]:
        new = [Stub(tmp_path / f"requests-{len(started) + i}.jsonl", *flags) for i, flags in enumerate(flag_sets)]
        started.extend(new)
        for stub in new:
            stub.wait_ready()
        return new

    yield start
    for stub in started:
        stub.proc.kill()
        stub.proc.wait()


FAST_DECODE = ("--sim-decode-tok-per-s", "100000")  # 6,000 tokens decode in 0.006 s real


def thinking(tokens: int) -> str:
    """A prefix of ``tokens`` thinking tokens as the stub writes them (two bytes a token)."""
    return "t " * tokens


def test_cold_continuation_pays_its_prefix_at_the_prefill_rate_and_a_free_prefill_does_not(stubs):
    charged, free = stubs(
        ("--sim-prefill-tok-per-s", str(PREFILL), *FAST_DECODE), ("--sim-prefill-tok-per-s", "0", *FAST_DECODE)
    )
    prefix = 6000
    expected = real((prefix + PROMPT_TOKENS) / PREFILL)  # 0.6006 s real
    slow, _ = charged.ask("prompt-a", 10, thinking(prefix))
    fast, _ = free.ask("prompt-a", 10, thinking(prefix))
    assert slow >= EARLY * expected
    assert slow - fast <= expected + SLACK
    assert fast < expected / 2
    (admitted,) = charged.events("prefill", "prompt-a")
    charged_as = (admitted["prefill_tokens"], admitted["cached_tokens"], admitted["continued_from"])
    assert charged_as == (prefix + PROMPT_TOKENS, 0, prefix)
    (recv,) = charged.events("recv", "prompt-a")
    assert recv["continued_from"] == prefix and recv["prefix_head"] == "t t t t t t " and recv["max_tokens"] == 10


def test_continuation_right_after_its_prefix_was_written_hits_the_cache_and_a_longer_one_pays_the_rest(stubs):
    (stub,) = stubs(("--sim-prefill-tok-per-s", str(PREFILL), *FAST_DECODE))
    written = 6000
    _, first = stub.ask("prompt-b", written)
    text = first["choices"][0]["message"]["reasoning_content"]
    assert first["usage"]["completion_tokens"] == written and text == thinking(written)
    took, second = stub.ask("prompt-b", 10, text)  # the drain's next chunk: the text just written, sent back
    assert second["usage"]["completion_tokens"] == 10
    assert took < real((written + PROMPT_TOKENS) / PREFILL) / 2  # a cold one takes 0.6 s
    (_, hit) = stub.events("prefill", "prompt-b")
    assert (hit["cached_tokens"], hit["prefill_tokens"]) == (PROMPT_TOKENS + written, 0)
    # the cache now holds written + 10 generated tokens; a prefix of 8,000 pays for the 1,990 beyond them
    took, _ = stub.ask("prompt-b", 10, thinking(8000))
    (_, _, partial) = stub.events("prefill", "prompt-b")
    assert (partial["cached_tokens"], partial["prefill_tokens"]) == (PROMPT_TOKENS + written + 10, 8000 - written - 10)
    assert took >= EARLY * real((8000 - written - 10) / PREFILL)
    # the same prefix under another conversation is cold on the same server
    took, _ = stub.ask("prompt-other", 10, text)
    (cold,) = stub.events("prefill", "prompt-other")
    assert (cold["cached_tokens"], cold["prefill_tokens"]) == (0, PROMPT_TOKENS + written)
    assert took >= EARLY * real((written + PROMPT_TOKENS) / PREFILL)


def test_a_decode_stalls_while_another_requests_cold_prefill_runs(stubs):
    decode_rate = 1000.0
    (stub,) = stubs(("--sim-prefill-tok-per-s", str(PREFILL), "--sim-decode-tok-per-s", str(decode_rate)))
    long_tokens, prefix = 6000, 3000
    decode = real(long_tokens / decode_rate)  # 0.6 s real alone
    prefill = real((prefix + PROMPT_TOKENS) / PREFILL)  # 0.3006 s real, all of it inside the decode
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(long=stub.ask("prompt-long", long_tokens)))
    runner.start()
    deadline = time.monotonic() + 10
    while not stub.events("prefill", "prompt-long") and time.monotonic() < deadline:
        time.sleep(0.01)
    cold_took, _ = stub.ask("prompt-cold", 1, thinking(prefix))
    runner.join()
    long_took, reply = result["long"]
    assert reply["usage"]["completion_tokens"] == long_tokens
    (long_in,), (cold_in,) = stub.events("prefill", "prompt-long"), stub.events("prefill", "prompt-cold")
    assert cold_in["t"] - long_in["t"] < decode - 0.1  # precondition: the prefill began while the decode ran
    assert cold_took >= EARLY * prefill
    assert long_took >= EARLY * (decode + prefill)
    assert long_took <= decode + prefill + SLACK
    (done,) = stub.events("done", "prompt-long")
    assert done["stalled_s"] == pytest.approx(prefill * SPEED, abs=1e-3)  # the prefill's simulated length


def test_a_full_pool_evicts_the_least_recently_used_sequence_and_its_continuation_pays_again(stubs):
    written, chunk = 3000, 10
    sequence = PROMPT_TOKENS + written
    pool = int(2.5 * sequence)  # two finished sequences fit, a third running one does not
    # a quarter of PREFILL's rate: a miss charges 1.2 s real, so a hit's HTTP time on a loaded machine (0.17 s seen
    # in a whole-suite run) stays far below half of it
    prefill = PREFILL / 4
    (stub,) = stubs(("--sim-prefill-tok-per-s", str(prefill), "--sim-kv-cache-tokens", str(pool), *FAST_DECODE))
    for key in ("prompt-A", "prompt-B", "prompt-C"):  # C's admission evicts A, the oldest
        stub.ask(key, written)
    took_b, _ = stub.ask("prompt-B", chunk, thinking(written))  # a hit: B is the most recent now
    took_a, _ = stub.ask("prompt-A", chunk, thinking(written))  # a miss; admitting it evicts C, not B
    stub.ask("prompt-C", chunk, thinking(written))
    charged = real(sequence / prefill)  # 1.2024 s real

    def charges(key: str) -> list[tuple[int, int]]:
        return [(e["cached_tokens"], e["prefill_tokens"]) for e in stub.events("prefill", key)]

    assert charges("prompt-B") == [(0, PROMPT_TOKENS), (sequence, 0)]
    assert charges("prompt-A") == [(0, PROMPT_TOKENS), (0, sequence)]
    assert charges("prompt-C") == [(0, PROMPT_TOKENS), (0, sequence)]  # B's hit made C the older one
    assert took_a >= EARLY * charged and took_b < charged / 2


def test_a_request_hung_in_its_prefill_never_finishes(stubs):
    (stub,) = stubs(("--sim-prefill-tok-per-s", str(PREFILL), *FAST_DECODE))
    prefill = real((6000 + PROMPT_TOKENS) / PREFILL)  # 0.6 s real
    timer = threading.Timer(prefill / 3, lambda: os.kill(stub.proc.pid, signal.SIGUSR1))
    timer.start()
    with pytest.raises(httpx.ReadTimeout):
        stub.ask("prompt-hang", 10, thinking(6000), timeout=prefill + 1.0)
    timer.join()
    assert stub.events("prefill", "prompt-hang") and not stub.events("done", "prompt-hang")
    assert httpx.get(f"{stub.url}/health", timeout=5).status_code == 200
