"""Where a row's tokens come from: the serving engine, its version and the chat template it renders with, asked of
the servers once when a pool is ready (no Dagster imports).

Every completions and tokenized row records them (``engine``, ``engine_version``, ``template_sha256``), so a row
says which engine's ids it holds, or whose rendering the project reproduced for it. How each engine says its
version, read from its code:

- SGLang 0.5.23: ``GET /server_info`` (``/get_server_info`` before) holds ``"version"`` (``sglang/srt/entrypoints/
  http_server.py``, ``get_server_info``: ``__version__``) and its ``ServerArgs``, ``enable_deterministic_inference``
  among them (without it SGLang drops a request's ``seed``: ``sampling/sampling_batch_info.py`` builds
  ``sampling_seed`` only when deterministic inference is on). The simulator answers ``sglang_stub (simulated)``.
- vLLM 0.32.0: ``GET /version`` gives ``{"version": ...}`` (``vllm/entrypoints/serve/instrumentator/basic.py``,
  ``show_version``); vLLM samples a request with its own ``seed`` whatever the server's flags.
- ``transformers serve`` has no version route: the local server runs this interpreter's transformers.

What is not known is ``"unknown"``, never a guess.
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import httpx

from dflash_assets.generation.api.urls import origin

UNKNOWN = "unknown"
#: ``seed_honoured`` values: the servers sample a request with its seed, they drop it, or nobody can tell
SEED_HONOURED, SEED_DROPPED, SEED_UNKNOWN = "yes", "no", UNKNOWN

__all__ = [
    "SEED_DROPPED",
    "SEED_HONOURED",
    "SEED_UNKNOWN",
    "UNKNOWN",
    "server_facts",
    "server_origin",
    "template_sha256",
]


def template_sha256(chat_template: str | Path | None = None, model_dir: str | Path | None = None) -> str:
    """SHA-256 (hex) of the chat template a server renders with: the file ``chat_template`` (``target_model.
    chat_template``, given to the servers as ``--chat-template``), else ``model_dir``'s own (its
    ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` text), else :data:`UNKNOWN`."""
    text = None
    try:
        if chat_template is not None:
            text = Path(chat_template).read_text(encoding="utf-8")
        elif model_dir is not None:
            own = Path(model_dir) / "chat_template.jinja"
            if own.is_file():
                text = own.read_text(encoding="utf-8")
            else:
                config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
                text = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
    except (OSError, ValueError):
        text = None
    return hashlib.sha256(text.encode()).hexdigest() if text else UNKNOWN


def text_sha256(text: str | None) -> str:
    """SHA-256 (hex) of a template's text (a tokenizer's ``chat_template``), :data:`UNKNOWN` for none."""
    return hashlib.sha256(text.encode()).hexdigest() if isinstance(text, str) and text else UNKNOWN


def server_facts(backend: str, base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the server at ``base_url`` says of itself: ``engine_version`` and ``seed_honoured`` (module docstring);
    :data:`UNKNOWN` for what it does not say or when it does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    facts: dict[str, Any] = {"engine_version": UNKNOWN, "seed_honoured": SEED_UNKNOWN}
    if backend == "transformers":
        try:
            facts["engine_version"] = f"transformers {version('transformers')}"
        except PackageNotFoundError:
            pass
        return facts
    paths = {"sglang": ("/server_info", "/get_server_info"), "vllm": ("/version",)}.get(backend, ())
    for path in paths:
        try:
            reply = httpx.get(origin(base_url) + path, headers=headers, timeout=timeout_s)
            info = reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, RecursionError):
            info = None
        if not isinstance(info, dict):
            continue
        if isinstance(info.get("version"), str) and info["version"]:
            facts["engine_version"] = f"{backend} {info['version']}"
        if backend == "vllm":
            facts["seed_honoured"] = SEED_HONOURED
        elif isinstance(info.get("enable_deterministic_inference"), bool):
            facts["seed_honoured"] = SEED_HONOURED if info["enable_deterministic_inference"] else SEED_DROPPED
        break
    return facts


def server_origin(
    backend: str,
    base_urls: list[str],
    api_key: str | None = None,
    chat_template: str | Path | None = None,
    model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """What every row made by these servers records: ``engine`` (the backend), ``engine_version`` and
    ``seed_honoured`` (:func:`server_facts` of the first server; a second disagreeing on the version makes it
    :data:`UNKNOWN`), ``template_sha256`` (:func:`template_sha256`; ``model_dir`` None: servers someone else
    started, whose template is theirs: :data:`UNKNOWN`)."""
    facts = [server_facts(backend, url, api_key) for url in base_urls[:2]]
    first = facts[0] if facts else {"engine_version": UNKNOWN, "seed_honoured": SEED_UNKNOWN}
    agree = all(f["engine_version"] == first["engine_version"] for f in facts)
    sha = template_sha256(chat_template, model_dir) if model_dir is not None else UNKNOWN
    return {
        "engine": backend,
        "engine_version": first["engine_version"] if agree else UNKNOWN,
        "seed_honoured": first["seed_honoured"],
        "template_sha256": sha,
    }


def seed_refusal(origin: dict[str, Any], seed: int | None) -> str | None:
    """Why a run with ``generation.seed`` ``seed`` must not use servers that said ``origin``, or None: they said
    they drop a request's seed (an SGLang whose ``/server_info`` has ``enable_deterministic_inference`` false), so
    every row would record a seed no sampling used. Servers that say nothing (``seed_honoured`` unknown) are used;
    the completions metadata and the run's summary say it cannot be known."""
    if seed is None or origin.get("seed_honoured") != SEED_DROPPED:
        return None
    return (
        f"resources.generation.seed is {seed}, but the {origin.get('engine')} servers run without "
        "--enable-deterministic-inference (their /server_info says so): SGLang drops a request's seed without it, and "
        "no row would be sampled with the seed it records; restart them with the flag (docs/configuration.md, "
        "resources.generation: its cost) or remove resources.generation.seed"
    )
