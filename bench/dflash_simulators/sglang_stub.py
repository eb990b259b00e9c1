"""A stand-in for ``python -m sglang.launch_server`` that behaves in *time* like one GPU server.

Run it exactly where SGLang would run (``inference.sglang.launch_module: dflash_simulators.sglang_stub``):
it takes SGLang's flags (``--model-path --host --port --max-running-requests --api-key``; others are
accepted and ignored) plus its own ``--sim-*`` flags (pass them through ``inference.sglang.extra_args``), and
SGLang's ``--config FILE.yaml`` (:func:`merge_config_file`: each ``key: value`` becomes ``--key value``
ahead of the command line, which wins), the way the launcher hands over the API key.

What it simulates, all in *simulated seconds* divided by ``--sim-speed`` to get real seconds:

- start-up (``--sim-startup-s``, default 180 s: weights + CUDA-graph capture): the port opens only then;
- ``--max-running-requests`` slots decoding at ``--sim-decode-tok-per-s`` each (default 87.5 tok/s:
  3,500 tok/s per GPU over 40 slots); requests beyond the slots wait in a FIFO queue, as in SGLang;
- output lengths from a lognormal (median ``--sim-median-tokens`` 1,970, sigma ``--sim-sigma`` 0.8: ~18%
  above 4,096, ~4% above 8,192), drawn from a hash of the request's messages, so one prompt has one
  length whatever the cap (a cap raise regenerates consistently and only the cut rows grow);
- the reply of an SGLang server with ``--reasoning-parser``: ``message.reasoning_content`` (first 90% of
  the tokens; null when the part written holds none) and ``message.content`` (the rest; ``""`` when the
  cap cuts inside the thinking),
  ``finish_reason`` ``length`` when the drawn length exceeds ``max_tokens`` (``completion_tokens`` =
  the cap), else ``stop``; ``usage.prompt_tokens``/``completion_tokens``;
- SGLang's ``continue_final_message``: a final assistant message is a prefix the model already wrote; it
  is left out of the length draw (so the sequence keeps its one length), its tokens (words) count as
  done, and only the rest is generated, under ``max_tokens``. With ``separate_reasoning: false`` the reply
  is the raw text (``</think>`` where the thinking closes) in ``message.content``;
- prefill: a request's uncached prompt tokens (``usage.prompt_tokens`` plus a continued prefix's tokens)
  are computed at ``--sim-prefill-tok-per-s`` (default 9,000 tok/s: a ~27B dense model, 2 x 27e9 FLOP
  per token, at ~50% of an H200's ~990 bf16 TFLOPS) before its decode starts, one prefill at a time per
  server, holding the request's slot; while a prefill runs every decoding request on the server is
  stalled (SGLang runs a prefill batch between decode steps), so a request decoding for D simulated
  seconds finishes after D seconds *not* spent in prefills. ``0``: prefill is free;
- a radix (prefix) cache: finished sequences are kept per server, keyed by the conversation without the
  continued prefix; a request whose conversation is cached gets its prompt and up to the cached
  generated tokens of its prefix as hits, and only the rest is prefilled (no sharing across
  conversations, e.g. a common system prompt: conservative). The pool, ``--sim-kv-cache-tokens``
  (default 270,000: ~70 GB of KV at ~256 KB per token for a Qwen3-32B-class model, 64 layers x 8 KV
  heads x 128 x K and V x bf16), holds the cached sequences and the running requests (prompt + prefix
  + their ``completion_tokens``); cached sequences are evicted least-recently-used when it overflows
  (a hit takes the sequence out while it runs and puts it back, most recent, when it finishes). The
  pool bounds only what stays cached: admission is by slots alone;
- routes ``POST /v1/chat/completions``, ``POST /generate`` (SGLang's native endpoint: ``input_ids`` and
  ``sampling_params``, the reply's ``meta_info``), ``GET /v1/models``, ``/server_info`` (and the older
  ``/get_server_info``: ``"simulated": true``), ``/health``, ``/health_generate``; with ``--api-key``
  every route but ``/health*`` wants the bearer token, as SGLang's middleware does;
- DFLASH speculative decoding (:mod:`~dflash_simulators.sglang_dflash`): SGLang's flags, its
  refusals of an export at start-up, and per-request ``spec_*`` fields whose acceptance is simulated.

Faults on demand: ``--sim-ignore-continue`` answers continuations afresh (an SGLang before 0.4.4);
SIGUSR1 makes it hang (``/health`` keeps answering 200, no request finishes, and
``/health_generate`` never answers, as with a stuck scheduler); ``--sim-hang-after N`` does the same after
N finished requests; kill -9 is a dead server.

Bookkeeping for benches: every start appends one line to ``--sim-starts-file``; every request arrival
and finish appends one JSON line to ``--sim-request-log`` (``{"ev": "recv"|"done", "key", "max_tokens",
"tokens", "t"}``, plus ``continued_from`` (prefix tokens) and ``prefix_head`` (its first characters) on
``recv``; ``key`` = the last user message, which the benches make the prompt's id).
Admission (the request gets its slot; the cache is looked up then) appends ``{"ev": "prefill", "key",
"max_tokens", "continued_from", "prefill_tokens" (uncached, charged), "cached_tokens", "t"}``; ``done``
also carries ``stalled_s``, the simulated seconds its decode waited for other requests' prefills.

Where it differs from SGLang 0.5.23 (whose own models judge the project's requests and replies in
``dflash_assets_tests/test_sglang_contract.py``): without ``--sim-tokenizer`` there is no tokenizer: the prompt is
not rendered (``usage.prompt_tokens`` counts the messages' words + 5), ``tools`` and ``tool_choice`` change nothing,
no ``prompt_token_ids`` come back, and generated ids come back as ``choices[0].response_token_ids`` only with
``--sim-token-ids`` (SGLang: whenever ``return_token_ids`` is asked), so tests that tokenize the stub's text keep
their references; those ids are :data:`~dflash_simulators.simulated_replies.THINK_TOKEN_ID` / ``ANSWER_TOKEN_ID``
per token, no real vocabulary. With ``--sim-tokenizer`` (``--model-path`` a model directory, ``--chat-template``
as SGLang takes it) the prompt is rendered as SGLang renders it, tools included as its ``Tool`` model dumps them
and dropped under ``tool_choice`` "none", and a ``return_token_ids`` reply carries ``choices[0].prompt_token_ids``
and ``response_token_ids`` that decode to its text (:mod:`~dflash_simulators.sim_render`, whose docstring lists
what remains different: no reasoning parser there, the text all in ``content``).
``/generate``'s ``output_ids`` are zeros. No context limit
(SGLang: HTTP 400 when prompt + ``max_new_tokens`` exceed ``--context-length``), and ``seed`` is neither used
nor refused. A continuation past the thinking gets its text as ``content`` with ``reasoning_content`` null;
SGLang's reasoning parser, which never sees the prefix's ``</think>`` and is forced on by a template that opens
the thinking, labels that text ``reasoning_content`` (``content: ""``). As in SGLang: ``content`` is ``""`` on
a cut inside thinking, ``reasoning_content`` null with no reasoning, and a ``/generate`` sampling key
``SamplingParams`` does not take is HTTP 400.

Stdlib (asyncio streams, HTTP/1.1 keep-alive with Content-Length bodies) plus PyYAML for ``--config``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import yaml

from dflash_simulators.http11 import read_request
from dflash_simulators.radix_cache import RadixCache
from dflash_simulators.sglang_dflash import DFlashSim
from dflash_simulators.sglang_dflash import add_arguments as add_dflash_arguments

#: the API fields of SGLang 0.5.23's ``SamplingParams`` (``srt/sampling/sampling_params.py``): ``/generate``
#: answers 400 to any other ``sampling_params`` key
SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
        "custom_params", "watermark",
    }
)  # fmt: skip
from dflash_simulators.sim_render import SimRenderer
from dflash_simulators.simulated_replies import (
    ANSWER_TOKEN_ID,
    THINK_TOKEN_ID,
    drawn_length,
    prompt_tokens_of,
    reply_fields,
    reply_token_ids,
)


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


class Simulator:
    """State of one simulated server: slots, clock scaling, prefill lock and stall clock, radix cache,
    hang switch, logs, and the DFlash drafter when one is served."""

    def __init__(self, args: argparse.Namespace, dflash: DFlashSim | None = None) -> None:
        self.args = args
        self.dflash = dflash
        self.renderer = SimRenderer(args.model_path, args.chat_template) if args.sim_tokenizer else None
        self.speed = args.sim_speed
        self.slots = asyncio.Semaphore(args.max_running_requests)
        self.ready = False
        self.hung = asyncio.Event()
        self.finished = 0
        self.cache = RadixCache(args.sim_kv_cache_tokens)
        self._prefill_lock = asyncio.Lock()
        self._stall_s = 0.0  # simulated seconds of prefills finished on this server, all requests
        self._prefill_since: float | None = None  # time.monotonic() when the running prefill began
        self._prefill_s = 0.0  # simulated seconds the running prefill takes
        self._no_prefill = asyncio.Event()
        self._no_prefill.set()
        # open for the server's whole life (closed at exit), line-buffered so each event lands whole
        self._request_log = (
            open(args.sim_request_log, "a", buffering=1) if args.sim_request_log else None  # noqa: SIM115
        )

    def real(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed

    def stalled_s(self) -> float:
        """Simulated seconds this server has spent in prefills so far (the running one as far as it got).
        Counted at their nominal length: event-loop lateness (times ``--sim-speed``) is no stall."""
        if self._prefill_since is None:
            return self._stall_s
        return self._stall_s + min(self._prefill_s, (time.monotonic() - self._prefill_since) * self.speed)

    async def prefill(self, tokens: int) -> None:
        """Compute ``tokens`` uncached prompt tokens at ``--sim-prefill-tok-per-s``, one prefill at a time.
        Taken even for 0 tokens, so a decode never starts in the middle of another request's prefill."""
        async with self._prefill_lock:
            self._prefill_since, self._prefill_s = time.monotonic(), tokens / self.args.sim_prefill_tok_per_s
            self._no_prefill.clear()
            try:
                await asyncio.sleep(self.real(self._prefill_s))
            finally:
                self._stall_s = self.stalled_s()
                self._prefill_since = None
                self._no_prefill.set()

    async def decode(self, sim_seconds: float) -> float:
        """Wait until ``sim_seconds`` simulated seconds have passed outside other requests' prefills
        (started after this decode); returns the simulated seconds stalled."""
        start, stall0 = time.monotonic(), self.stalled_s()
        while True:
            if self._prefill_since is not None:  # stalled until it ends (then perhaps by the next one)
                await self._no_prefill.wait()
                continue
            stalled = self.stalled_s() - stall0
            left = sim_seconds - ((time.monotonic() - start) * self.speed - stalled)
            if left <= 0:
                return stalled
            await asyncio.sleep(self.real(left))

    async def run_request(self, prefill_tokens: int, decode_s: float) -> float:
        """Prefill (unless free) then decode; returns the simulated seconds the decode was stalled."""
        if self.args.sim_prefill_tok_per_s > 0:
            await self.prefill(prefill_tokens)
            return await self.decode(decode_s)
        await asyncio.sleep(self.real(decode_s))
        return 0.0

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
        key = next(
            (m.get("content") for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), ""
        )
        self.log_request(
            ev="recv",
            key=key,
            max_tokens=max_tokens,
            continued_from=done,
            prefix_head=None if prefix is None else prefix[:12],
        )
        fields = reply_fields(length, int(max_tokens), done, raw=body.get("separate_reasoning") is False)
        prompt_tokens = prompt_tokens_of(messages)
        prompt_ids = output_ids = None
        if self.renderer is not None:  # --sim-tokenizer: SGLang's rendering and ids that decode to the text
            prompt_ids = self.renderer.prompt_ids(body)
            drawn = reply_token_ids(length, int(max_tokens), done)
            output_ids = self.renderer.reply_ids(drawn.count(THINK_TOKEN_ID), drawn.count(ANSWER_TOKEN_ID))
            fields = {**fields, "reasoning_content": None, "content": self.renderer.text(output_ids)}
            prompt_tokens = len(prompt_ids)
        conversation = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        stalled = await self.occupy(key, max_tokens, (conversation, prompt_tokens, done, fields["completion_tokens"]))
        self.log_request(
            ev="done", key=key, max_tokens=max_tokens, tokens=fields["completion_tokens"], stalled_s=round(stalled, 6)
        )
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": fields["content"],
                "reasoning_content": fields["reasoning_content"],
            },
            "finish_reason": fields["finish_reason"],
        }
        if output_ids is not None and body.get("return_token_ids"):  # as SGLang: the prompt's ids beside them
            choice["prompt_token_ids"] = prompt_ids
            choice["response_token_ids"] = output_ids
        elif self.args.sim_token_ids and body.get("return_token_ids"):  # SGLang's chat name for the generated ids
            choice["response_token_ids"] = reply_token_ids(length, int(max_tokens), done)
        return {
            "id": f"sim-{self.finished}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.args.model_path,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": fields["completion_tokens"],
                "total_tokens": prompt_tokens + fields["completion_tokens"],
            },
        }

    async def native_generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """SGLang's ``/generate`` on token ids: a drawn length under ``max_new_tokens`` (stopping counts as a
        matched stop token), ``meta_info`` with the speculative fields when a drafter is served."""
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return 400, {"error": {"message": "the simulator's /generate takes input_ids (a list of ints)"}}
        if unknown := sorted(set(params) - SAMPLING_PARAMS):  # SGLang: SamplingParams(**params) raises, HTTP 400
            return 400, {"error": {"message": f"SamplingParams got unexpected keyword arguments {unknown}"}}
        max_new = int(params.get("max_new_tokens") or 128)
        length = drawn_length(ids, self.args.sim_median_tokens, self.args.sim_sigma, self.args.sim_seed)
        n = min(length, max_new)
        key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]  # = generation.servers.sglang_dflash.input_sha
        self.log_request(ev="recv", key=key, max_tokens=max_new, continued_from=0, prefix_head=None)
        spec = self.dflash.spec_fields(ids, n) if self.dflash is not None else {}
        stalled = await self.occupy(key, max_new, (key, len(ids), 0, n), decode_tokens=spec.get("spec_verify_ct", n))
        stops = list(params.get("stop_token_ids") or [])
        finish = (
            {"type": "length", "length": max_new}
            if length > max_new
            else {"type": "stop", "matched": stops[0] if stops else 0}
        )
        self.log_request(ev="done", key=key, max_tokens=max_new, tokens=n, stalled_s=round(stalled, 6), **spec)
        meta = {
            "id": f"sim-{self.finished}",
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            **spec,
        }
        return 200, {"text": "a " * n, "output_ids": [0] * n, "meta_info": meta}

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: the fields a client reads, and ``simulated: true``."""
        return {
            "version": "sglang_stub (simulated)",
            "simulated": True,
            "model_path": self.args.model_path,
            "tp_size": self.args.tp_size,
            "max_running_requests": self.args.max_running_requests,
            "speculative_algorithm": None,
            "enable_deterministic_inference": self.args.enable_deterministic_inference,
            **(self.dflash.server_info() if self.dflash is not None else {}),
        }

    async def occupy(
        self, key: str, max_tokens: int, sequence: tuple[str, int, int, int], decode_tokens: int | None = None
    ) -> float:
        """Hold a slot for one request: admission, prefill, then ``decode_tokens`` (default the completion)
        steps of decode at the per-slot rate; returns the simulated seconds the decode was stalled."""
        async with self.slots:
            if self.hung.is_set():
                await asyncio.Event().wait()
            cached, prefill_tokens, held = self.cache.admit(*sequence)
            self.log_request(
                ev="prefill",
                key=key,
                max_tokens=max_tokens,
                continued_from=sequence[2],
                prefill_tokens=prefill_tokens,
                cached_tokens=cached,
            )
            # the slot is held for the prefill, then completion_tokens / per-slot rate of unstalled decode
            decode_s = (sequence[3] if decode_tokens is None else decode_tokens) / self.args.sim_decode_tok_per_s
            work = asyncio.ensure_future(self.run_request(prefill_tokens, decode_s))
            hang = asyncio.ensure_future(self.hung.wait())
            await asyncio.wait({work, hang}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.Event().wait()  # hung: never finishes
            hang.cancel()
            stalled = work.result()
            self.cache.finish(*sequence, held=held)
        self.finished += 1
        if self.args.sim_hang_after and self.finished >= self.args.sim_hang_after:
            self.hang()
        return stalled

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        path = path.split("?", 1)[0]
        if (
            self.args.api_key
            and headers.get("authorization") != f"Bearer {self.args.api_key}"
            and not path.startswith("/health")
        ):
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
        if path in ("/server_info", "/get_server_info"):
            return 200, self.server_info()
        if path == "/generate" and method == "POST":
            try:
                data = json.loads(body or b"{}")
            except ValueError:
                return 400, {"error": {"message": "body is not JSON"}}
            return await self.native_generate(data)
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
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
                if request.wants_close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()


def merge_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with SGLang's ``--config FILE`` replaced by the file's flags, put first so the command line
    wins, as SGLang's ``ConfigArgumentMerger`` does: the file must end in ``.yaml`` / ``.yml`` and hold a
    mapping; ``key: value`` becomes ``--key value``, ``key: true`` of a switch ``--key`` (``false``: left
    out), a list ``--key v1 v2``. One ``--config`` at most (parser errors otherwise)."""
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        parser.error("Multiple config files specified! Only one allowed.")
    at = argv.index("--config")
    if at == len(argv) - 1:
        parser.error("No config file specified after --config flag!")
    path = argv[at + 1]
    if not path.lower().endswith((".yaml", ".yml")):
        parser.error(f"Config file must be YAML format, got: {os.path.splitext(path)[1]}")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"Failed to read config file {path}: {type(exc).__name__}")
    if not isinstance(data, dict):
        parser.error("Config file must contain a dictionary at root level")
    switches = {o for a in parser._actions if isinstance(a, argparse._StoreTrueAction) for o in a.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        flag = f"--{key}"
        if isinstance(value, bool) and flag in switches:
            flags += [flag] if value else []
        elif isinstance(value, bool):
            flags += [flag, str(value).lower()]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        else:
            flags += [flag, str(value)]
    return flags + argv[:at] + argv[at + 2 :]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="simulated-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=40)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--chat-template", default=None, help="as SGLang's: the Jinja template file (used with --sim-tokenizer)"
    )
    p.add_argument("--enable-deterministic-inference", action="store_true", help="reported in /server_info")
    p.add_argument("--sim-startup-s", type=float, default=180.0, help="simulated seconds until the port opens")
    p.add_argument("--sim-decode-tok-per-s", type=float, default=87.5, help="decode rate of one slot, simulated tok/s")
    p.add_argument(
        "--sim-prefill-tok-per-s",
        type=float,
        default=9000.0,
        help="prefill rate of the server, simulated tok/s (default 9000: a ~27B dense model, 2 x 27e9 FLOP "
        "per token, at ~50%% of an H200's ~990 bf16 TFLOPS); decodes stall while it runs; 0: free",
    )
    p.add_argument(
        "--sim-kv-cache-tokens",
        type=int,
        default=270000,
        help="KV pool of the radix cache, tokens (default 270000: ~70 GB at ~256 KB per token, a Qwen3-32B-class "
        "model: 64 layers x 8 KV heads x 128 x K and V x bf16)",
    )
    p.add_argument("--sim-speed", type=float, default=1.0, help="simulated seconds per real second")
    p.add_argument("--sim-median-tokens", type=float, default=1970.0)
    p.add_argument("--sim-sigma", type=float, default=0.8)
    p.add_argument("--sim-seed", default="")
    p.add_argument(
        "--sim-token-ids",
        action="store_true",
        help="answer return_token_ids with choices[0].response_token_ids, as SGLang does (off: no ids)",
    )
    p.add_argument(
        "--sim-tokenizer",
        action="store_true",
        help="load --model-path's tokenizer: render each chat request as SGLang does (tools dumped by its Tool model, "
        "none with tool_choice none), return its prompt_token_ids and ids that decode to the reply (sim_render.py)",
    )
    p.add_argument("--sim-starts-file", default=None, help="append one line per start")
    p.add_argument("--sim-request-log", default=None, help="append one JSON line per request arrival and finish")
    p.add_argument("--sim-hang-after", type=int, default=0, help="hang after this many finished requests (0: never)")
    p.add_argument(
        "--sim-ignore-continue",
        action="store_true",
        help="ignore continue_final_message (as SGLang < 0.4.4): answer afresh",
    )
    add_dflash_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    argv = merge_config_file(sys.argv[1:] if argv is None else list(argv), p)
    args, _unknown = p.parse_known_args(argv)  # SGLang flags we do not model (--tp-size, --reasoning-parser ...)
    if args.sim_speed <= 0 or args.sim_decode_tok_per_s <= 0 or args.max_running_requests < 1:
        p.error("--sim-speed, --sim-decode-tok-per-s and --max-running-requests must be positive")
    if args.sim_prefill_tok_per_s < 0 or args.sim_kv_cache_tokens < 0:
        p.error("--sim-prefill-tok-per-s and --sim-kv-cache-tokens must be 0 or more")
    return args


async def serve(args: argparse.Namespace, dflash: DFlashSim | None = None) -> None:
    sim = Simulator(args, dflash)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, sim.hang)
    born = process_start_time()
    if args.sim_starts_file:
        with open(args.sim_starts_file, "a") as f:
            f.write(f"{born:.3f} pid={os.getpid()} port={args.port}\n")
    # SGLang logs its whole ServerArgs, API key included, at start-up; so does the stand-in
    print(f"server_args={args!r}", flush=True)
    print(
        f"sglang_stub {args.port}: starting (pid {os.getpid()}, {args.sim_startup_s:g} simulated s start-up, "
        f"speed x{args.sim_speed:g}, {args.max_running_requests} slots)",
        flush=True,
    )
    await asyncio.sleep(max(0.0, born + sim.real(args.sim_startup_s) - time.time()))
    server = await asyncio.start_server(sim.handle, args.host, args.port, reuse_address=True, backlog=4096)
    sim.ready = True
    print(f"sglang_stub {args.port}: ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    argv = merge_config_file(sys.argv[1:] if argv is None else list(argv), _parser())
    args = parse_args(argv)
    dflash = DFlashSim.from_args(args, argv)  # refuses an export SGLang would refuse, before the port opens
    try:
        asyncio.run(serve(args, dflash))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
