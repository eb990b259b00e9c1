"""Fault tests of the async generation client against a scriptable fake OpenAI-compatible server.

The stand-in server (bench/dflash_simulators/stand_in_server.py) stands in only for faults a real server
cannot be made to show on demand: 503 bursts, hangs, connections dropped mid-reply, a server dying mid-run.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import Counter

import pytest

from dflash_assets.generation.api.replies import parse_chat_completion
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.client.results import CompletionResult, GenerationProgress, TooManyFailuresError
from dflash_simulators.behaviours import Drop, Error, Hang, Raw, Reply, fail_first
from dflash_simulators.stand_in_server import FakeServer

SECRET = "sk-test-SECRET-0123456789"
FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05)  # keep retries quick in tests


def body(i: int) -> dict:
    """A request body whose user message names its row, so scripts and checks can tell rows apart."""
    return {"model": "fake", "messages": [{"role": "user", "content": f"row {i}"}], "max_tokens": 32}


def row_of(request_body: dict) -> int:
    return int(request_body["messages"][0]["content"].split()[1])


def run(client: CompletionClient, n: int) -> tuple[list[CompletionResult], GenerationProgress]:
    results: list[CompletionResult] = []
    progress = asyncio.run(client.generate(((i, body(i)) for i in range(n)), results.append))
    return results, progress


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parsing -------------------------------------------------------------------------------------


def test_parse_chat_completion_fields_and_token_id_sources():
    base = {
        "choices": [{"message": {"content": "A", "reasoning": "R"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9},
    }
    f = parse_chat_completion(base)
    assert (f["content"], f["reasoning_content"], f["finish_reason"]) == ("A", "R", "length")
    assert (f["prompt_tokens"], f["completion_tokens"], f["output_token_ids"]) == (3, 9, None)
    assert f["output_token_ids_source"] == "none"

    # SGLang 0.5.23's chat endpoint (issue 38: read as token_ids, every SGLang row lost its ids)
    sglang = {
        "choices": [
            {
                "message": {"content": "A", "reasoning_content": "R2"},
                "finish_reason": "stop",
                "response_token_ids": [5, 6, 7],
                "prompt_token_ids": [1, 2],
            }
        ]
    }
    f = parse_chat_completion(sglang)
    assert f["reasoning_content"] == "R2"
    assert f["output_token_ids"] == [5, 6, 7] and f["prompt_token_ids"] == [1, 2]
    assert f["output_token_ids_source"] == "response_token_ids"
    assert f["prompt_tokens"] is None and f["completion_tokens"] is None  # no usage block

    vllm = {"choices": [{"message": {"content": "A"}, "token_ids": [4, 3]}]}
    assert (
        parse_chat_completion(vllm)["output_token_ids"],
        parse_chat_completion(vllm)["output_token_ids_source"],
    ) == (
        [4, 3],
        "token_ids",
    )
    old = {"choices": [{"message": {"content": "A"}, "output_ids": [9, 8]}]}
    assert parse_chat_completion(old)["output_token_ids"] == [9, 8]
    assert parse_chat_completion(old)["output_token_ids_source"] == "output_ids"

    logprobs = {
        "choices": [
            {
                "message": {"content": "A"},
                "logprobs": {
                    "content": [
                        {"token": "a", "logprob": -0.1, "token_id": 11},
                        {"token": "b", "logprob": -0.2, "token_id": 12},
                    ]
                },
            }
        ]
    }
    assert parse_chat_completion(logprobs)["output_token_ids"] == [11, 12]
    assert parse_chat_completion(logprobs)["output_token_ids_source"] == "logprobs"
    partial = {"choices": [{"message": {}, "logprobs": {"content": [{"token": "a", "logprob": -0.1}]}}]}
    assert parse_chat_completion(partial)["output_token_ids"] is None

    with pytest.raises(ValueError):
        parse_chat_completion({"object": "error", "message": "boom"})


# --- normal operation ------------------------------------------------------------------------------


def test_results_parsed_bodies_sent_verbatim_and_key_in_header():
    reply = Reply(
        content="ans",
        reasoning="think",
        finish_reason="length",
        prompt_tokens=20,
        completion_tokens=64,
        token_ids=[4, 5, 6],
    )
    with FakeServer(reply) as server:
        client = CompletionClient([server.url], api_key=SECRET, concurrency=4, **FAST)
        results, progress = run(client, 10)
    assert sorted(r.index for r in results) == list(range(10))
    r = results[0]
    assert (r.content, r.reasoning_content, r.finish_reason) == ("ans", "think", "length")
    assert (r.prompt_tokens, r.completion_tokens, r.output_token_ids) == (20, 64, [4, 5, 6])
    assert (r.error, r.attempts, r.server) == (None, 1, server.url)
    assert r.latency_s > 0
    assert sorted(server.bodies, key=row_of) == [body(i) for i in range(10)]
    assert set(server.auth_headers) == {f"Bearer {SECRET}"}
    assert (progress.rows_done, progress.rows_failed, progress.requests_sent) == (10, 0, 10)
    assert progress.output_tokens == 10 * 64


def test_vllm_reasoning_field_and_v1_suffix_in_base_url():
    with FakeServer(Reply(reasoning="vllm thinks", reasoning_field="reasoning")) as server:
        client = CompletionClient([server.url + "/v1/"], concurrency=1, **FAST)
        results, _ = run(client, 1)
    assert results[0].reasoning_content == "vllm thinks"
    assert server.requests_received == 1


def test_results_delivered_in_completion_order_and_concurrency_bounded():
    def script(n, b):
        return Reply(delay_s=0.4 if row_of(b) == 0 else 0.0)

    with FakeServer(script) as server:
        client = CompletionClient([server.url], concurrency=3, **FAST)
        results, _ = run(client, 12)
    order = [r.index for r in results]
    assert order[-1] == 0  # the slow row 0 was sent first but finished last
    assert sorted(order) == list(range(12))
    assert server.max_concurrent <= 3


# --- retries -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 429, 500, 503])
def test_transient_status_retried_until_success(status):
    with FakeServer(fail_first(3, Error(status, "busy"))) as server:
        client = CompletionClient([server.url], concurrency=1, max_attempts=5, **FAST)
        results, progress = run(client, 1)
    assert len(results) == 1
    assert results[0].error is None and results[0].attempts == 4
    assert server.requests_received == 4
    assert progress.requests_sent == 4


def test_503_beyond_attempt_budget_is_a_failed_row():
    with FakeServer(Error(503, "overloaded")) as server:
        client = CompletionClient([server.url], concurrency=1, max_attempts=3, **FAST)
        results, _ = run(client, 1)
    assert server.requests_received == 3
    (r,) = results
    assert r.attempts == 3 and r.content is None
    assert "HTTP 503" in r.error and "overloaded" in r.error and "gave up after 3 attempts" in r.error


def test_non_transient_400_fails_at_once_with_server_message():
    with FakeServer(Error(400, "max_tokens must be positive")) as server:
        client = CompletionClient([server.url], concurrency=1, max_attempts=5, **FAST)
        results, _ = run(client, 1)
    assert server.requests_received == 1
    (r,) = results
    assert r.attempts == 1
    assert r.error == f"HTTP 400 from {server.url}: max_tokens must be positive"


def test_malformed_200_reply_is_not_resent():
    # The server finished the generation; re-sending would pay for it again.
    with FakeServer(Raw(200, b"{truncated")) as server:
        client = CompletionClient([server.url], concurrency=1, max_attempts=5, **FAST)
        results, _ = run(client, 1)
    assert server.requests_received == 1
    assert results[0].attempts == 1 and results[0].error.startswith(f"malformed reply from {server.url}")


def test_hung_request_times_out_retried_and_delivered_once(caplog):
    # Request 0 hangs past the read timeout; the retry succeeds.
    with FakeServer(lambda n, b: Hang() if n == 0 else Reply()) as server:
        client = CompletionClient([server.url], concurrency=1, read_timeout_s=0.5, max_attempts=3, **FAST)
        with caplog.at_level(logging.WARNING, logger="dflash_assets.generation.client.completion_client"):
            results, _ = run(client, 1)
    assert [r.index for r in results] == [0]  # exactly one delivery, no duplicate
    assert results[0].error is None and results[0].attempts == 2
    assert server.requests_received == 2
    assert any("read timeout" in rec.getMessage() and "retrying" in rec.getMessage() for rec in caplog.records)


def test_hang_every_time_ends_as_error_after_policy():
    with FakeServer(Hang()) as server:
        client = CompletionClient([server.url], concurrency=2, read_timeout_s=0.2, max_attempts=2, **FAST)
        results, _ = run(client, 2)
    assert Counter(r.index for r in results) == {0: 1, 1: 1}
    assert all(r.attempts == 2 and "read timeout" in r.error for r in results)
    assert server.requests_received == 4


def test_read_timeout_not_retried_when_disabled():
    with FakeServer(Hang()) as server:
        client = CompletionClient(
            [server.url], concurrency=1, read_timeout_s=0.2, max_attempts=5, retry_read_timeouts=False, **FAST
        )
        results, _ = run(client, 1)
    assert server.requests_received == 1
    assert results[0].attempts == 1 and "read timeout" in results[0].error


def test_dropped_connection_mid_reply_is_retried():
    with FakeServer(lambda n, b: Drop() if n < 2 else Reply(content="ok")) as server:
        client = CompletionClient([server.url], concurrency=1, max_attempts=5, **FAST)
        results, _ = run(client, 1)
    assert results[0].error is None and results[0].content == "ok"
    assert results[0].attempts == 3 and server.requests_received == 3


# --- failure budget ------------------------------------------------------------------------------


def test_consecutive_non_transient_failures_stop_the_run():
    with FakeServer(Error(400, "model not found")) as server:
        client = CompletionClient([server.url], concurrency=1, max_consecutive_failures=5, **FAST)
        results: list[CompletionResult] = []
        items = ((i, body(i)) for i in range(100))
        with pytest.raises(TooManyFailuresError) as info:
            asyncio.run(client.generate(items, results.append))
    assert server.requests_received == 5  # concurrency 1: nothing was in flight past the 5th failure
    assert [r.index for r in results] == [0, 1, 2, 3, 4]
    message = str(info.value)
    assert server.url in message and "model not found" in message and "5 requests failed in a row" in message
    assert info.value.servers == [server.url]


def test_no_more_retries_once_the_run_is_stopping():
    # Row 0 fails for good at once and exhausts the budget (1); rows 1-3 got a 503 and wait to retry.
    def script(n, b):
        return Error(400, "bad") if row_of(b) == 0 else Error(503, "busy")

    with FakeServer(script) as server:
        client = CompletionClient(
            [server.url],
            concurrency=4,
            max_attempts=5,
            backoff_base_s=0.2,
            backoff_max_s=1.0,
            max_consecutive_failures=1,
        )
        results: list[CompletionResult] = []
        with pytest.raises(TooManyFailuresError):
            asyncio.run(client.generate(((i, body(i)) for i in range(50)), results.append))
    assert sorted(r.index for r in results) == [0, 1, 2, 3]
    assert all(r.attempts == 1 for r in results)  # without the stop they would retry 4 more times each
    assert server.requests_received == 4


def test_server_dies_mid_run():
    server = FakeServer(Reply(delay_s=0.05)).start()
    results: list[CompletionResult] = []
    killed = threading.Event()

    def on_result(result: CompletionResult) -> None:
        results.append(result)
        if len(results) == 20 and not killed.is_set():
            killed.set()
            threading.Thread(target=server.stop).start()  # dies while 4 requests are in flight

    client = CompletionClient([server.url], concurrency=4, max_attempts=2, max_consecutive_failures=6, **FAST)
    with pytest.raises(TooManyFailuresError) as info:
        asyncio.run(client.generate(((i, body(i)) for i in range(200)), on_result))
    server.stop()

    delivered = Counter(r.index for r in results)
    assert max(delivered.values()) == 1  # no duplicates
    received = {row_of(b) for b in server.bodies}
    assert received <= set(delivered)  # every request that reached the server was finished and delivered
    ok = {r.index for r in results if r.error is None}
    assert ok <= {row_of(b) for b in server.replied_ok}
    assert len(ok) >= 20
    failed = [r for r in results if r.error is not None]
    assert len(failed) >= 6 and len(results) < 200
    assert results[-1].error is not None
    assert info.value.consecutive_failures >= 6 and server.url in str(info.value)
    progress = client.progress()
    assert progress.rows_done == len(results) and progress.in_flight == 0


# --- routing -------------------------------------------------------------------------------------


def test_least_loaded_routing_prefers_the_fast_server():
    with FakeServer(Reply(delay_s=0.25)) as slow, FakeServer(Reply(delay_s=0.005)) as fast:
        client = CompletionClient([slow.url, fast.url], concurrency=8, **FAST)
        results, _ = run(client, 150)
    assert all(r.error is None for r in results)
    by_server = Counter(r.server for r in results)
    assert by_server[fast.url] + by_server[slow.url] == 150
    # Round-robin would give 75/75; least-in-flight keeps ~4 on each, so the fast one serves ~90%.
    assert by_server[fast.url] >= 3 * by_server[slow.url]
    assert client.requests_per_server() == {slow.url: slow.requests_received, fast.url: fast.requests_received}


def test_dead_server_is_routed_around():
    dead = f"http://127.0.0.1:{closed_port()}"
    with FakeServer(Reply(delay_s=0.01)) as live:
        client = CompletionClient([dead, live.url], concurrency=4, backoff_base_s=0.05, backoff_max_s=1.0)
        results, _ = run(client, 80)
    assert all(r.error is None and r.server == live.url for r in results)
    sent = client.requests_per_server()
    assert sent[live.url] == live.requests_received == 80
    assert sent[dead] < 20


# --- secrets -------------------------------------------------------------------------------------


def test_api_key_never_in_errors_logs_or_results(caplog):
    # A leaky server echoes the Authorization header into its error message.
    with FakeServer(Error(400, "bad request", echo_auth=True)) as server:
        client = CompletionClient([server.url], api_key=SECRET, concurrency=1, max_consecutive_failures=2, **FAST)
        results: list[CompletionResult] = []
        with caplog.at_level(logging.DEBUG), pytest.raises(TooManyFailuresError) as info:
            asyncio.run(client.generate(((i, body(i)) for i in range(5)), results.append))
    assert server.auth_headers[0] == f"Bearer {SECRET}"  # the key was sent, and echoed back
    assert results and all("***" in r.error for r in results)
    assert all(SECRET not in repr(r) for r in results)
    assert SECRET not in str(info.value)
    assert SECRET not in caplog.text and "***" in caplog.text
    assert SECRET not in repr(client)

    # Connection failures too (httpx messages carry the URL, never headers).
    client = CompletionClient(
        [f"http://127.0.0.1:{closed_port()}"], api_key=SECRET, concurrency=1, max_attempts=2, **FAST
    )
    results, _ = run(client, 1)
    assert results[0].error and SECRET not in results[0].error


# --- callback errors and progress ---------------------------------------------------------------


def test_callback_error_propagates_and_stops():
    with FakeServer(Reply()) as server:
        client = CompletionClient([server.url], concurrency=2, **FAST)
        seen: list[int] = []

        def on_result(result: CompletionResult) -> None:
            seen.append(result.index)
            if len(seen) == 3:
                raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            asyncio.run(client.generate(((i, body(i)) for i in range(1000)), on_result))
    assert len(seen) == 3
    assert server.requests_received < 10


def test_progress_snapshot_rates_and_eta():
    p = GenerationProgress(
        rows_done=50,
        rows_failed=2,
        requests_sent=55,
        in_flight=4,
        output_tokens=5000,
        elapsed_s=10.0,
        requests_per_s=5.0,
        output_tokens_per_s=500.0,
    )
    assert p.eta_s(150) == pytest.approx(20.0)  # 100 rows left at 5 rows/s
    assert p.format(150) == "50/150 rows (2 failed), 5.0 req/s, 500 output tok/s, 4 in flight, ETA 20 s"
    idle = GenerationProgress(0, 0, 0, 0, 0, 1.0, 0.0, 0.0)
    assert idle.eta_s(10) is None


def test_generate_blocking_and_credentials_kept_out_of_labels():
    with FakeServer(Reply()) as server:
        url_with_user = server.url.replace("http://", "http://user:pw@")
        client = CompletionClient([url_with_user], concurrency=2, **FAST)
        assert client.servers == [server.url]
        results: list[CompletionResult] = []
        progress = client.generate_blocking(((i, body(i)) for i in range(5)), results.append)
    assert sorted(r.index for r in results) == list(range(5)) and all(r.server == server.url for r in results)
    assert progress.rows_done == 5 and progress.output_tokens == 5 * Reply().completion_tokens


def test_constructor_validation():
    with pytest.raises(ValueError):
        CompletionClient([], concurrency=1)
    with pytest.raises(ValueError):
        CompletionClient(["http://127.0.0.1:1"], concurrency=0)
