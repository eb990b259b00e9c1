"""SGLang 0.5.23's own code as the judge of what the project sends it and reads from it (issue 38).

Run *inside* an environment that holds ``sglang==0.5.23`` installed ``--no-deps`` with a few pure-Python packages
(``dflash_assets_tests/test_sglang_contract.py`` makes it), as a script: ``python sglang_judge.py < cases.json``.
It imports nothing of this project (SGLang pins another torch, transformers and openai, so it cannot share the
project's environment); cases come in as a JSON list on stdin and one JSON result per case goes to stdout.

SGLang's modules import torch, triton, flashinfer, zmq, transformers and more at import time, none of which its
argument parser or its OpenAI protocol and response-building code use. :class:`_StandInFinder` answers those
imports (only the top-level names in :data:`HEAVY` that are not installed) with stand-in modules whose every
attribute is a permissive class, and claims one CUDA GPU of compute capability 10.0 (:data:`OVERRIDES`: SGLang
asks at import time). The ``sglang`` package's ``__init__`` (its frontend language) is not run. Each result says
which stand-ins were used (``stubbed``). No model code runs: what is judged is argparse, pydantic and the
response-building functions.

Cases (``op``):

- ``server_args``: ``argv`` parsed by ``ServerArgs.add_cli_args``'s parser (``namespace``: every dest, JSON-safe)
  and by ``prepare_server_args`` (``prepared``: the ``ServerArgs`` fields, or ``prepare_error``); an argparse
  refusal gives ``error`` with argparse's message. With ``--enable-deterministic-inference``, ``deterministic``:
  the attention backend, sampling backend and ``disable_radix_cache`` SGLang's ``handle_deterministic_inference``
  resolves them to at launch.
- ``chat_request``: ``body`` validated by ``ChatCompletionRequest`` (``error`` on a refusal); ``unknown``: the
  keys no field (or alias) of the model takes, which SGLang drops in silence; ``fields``: the validated values.
- ``generate_request``: ``body`` given to ``GenerateReqInput(**body)`` and its ``sampling_params`` to
  ``SamplingParams(**...)`` and ``verify(vocab_size)``, as ``/generate`` does (an error is SGLang's HTTP 400).
- ``chat_reply``: SGLang's ``OpenAIServingChat._build_chat_response`` makes the reply body to ``request`` (a
  chat body) from one engine output (``text``, ``output_ids``, ``finish_reason``, ``prompt_tokens``) with the
  reasoning parser of ``server_argv`` and what SGLang's ``detect_reasoning_pattern`` finds in ``chat_template``
  (the served template), serialized by SGLang's ``model_json_response``: ``body`` is the reply's JSON text.
- ``generate_meta``: the speculative fields of ``/generate``'s ``meta_info`` as SGLang's
  ``TokenizerManager._calculate_spec_decoding_metrics`` computes them from ``spec_verify_ct``,
  ``spec_num_correct_drafts``, ``completion_tokens``, ``num_draft_tokens`` and ``histogram``.
- ``chat_process``: what SGLang's chat endpoint makes of ``body`` before any model runs:
  ``OpenAIServingChat._convert_to_internal_request`` (``_process_messages`` -> ``_apply_jinja_template`` ->
  ``_render_and_encode_chat_template``) with a recording tokenizer in place of the model's. ``template_calls``:
  every ``tokenizer.apply_chat_template`` call, its messages, ``tools`` and keyword arguments exactly as SGLang
  hands them over (the rendered text is the recorder's, so only the inputs are judged; rendering them with the
  real tokenizer is the caller's); ``encoded``: other texts SGLang encoded (a continued message's prefix, whose ids
  it appends, one stand-in id per character); ``generate``: the ``GenerateReqInput`` it builds (``input_ids``: the
  ids the recorder's ``encode`` returned for the prompt, ``case["prompt_ids"]``, then those of ``encoded``;
  ``return_prompt_token_ids``, ``sampling_params``).
- ``length_check``: SGLang's own context-length rule (``TokenizerManager._validate_one_request``) on a prompt of
  ``prompt_tokens`` ids with ``max_new_tokens`` under ``context_length``: ``ok`` or SGLang's ``error``.
- ``router_args``: ``argv`` through ``sglang_router.launch_server``'s own ``main`` (sglang-router's parser:
  ``ServerArgs.add_cli_args``, ``RouterArgs.add_cli_args(use_router_prefix=True, exclude_host_port=True)``,
  ``--router-dp-worker-base-port``), stopped before any process starts: ``server`` (the ``ServerArgs`` it made),
  ``router`` (its ``RouterArgs``), ``worker_base_port``; an argparse refusal gives ``error``.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import sys
import types
from typing import Any

#: top-level modules SGLang imports that its parsers and protocol code never use; stood in when not installed
HEAVY = frozenset(
    {
        "IPython", "PIL", "aiohttp", "amdsmi", "compressed_tensors", "cuda", "deep_gemm", "einops", "fastapi",
        "flashinfer", "gguf", "huggingface_hub", "jinja2", "jsonschema", "opentelemetry", "partial_json_parser",
        "prometheus_client", "pynvml", "safetensors", "sentencepiece", "setproctitle", "sgl_kernel", "starlette",
        "tiktoken", "tokenizers", "torch", "torchao", "torchvision", "transformers", "triton", "tvm_ffi",
        "uvicorn", "uvloop", "xgrammar", "xxhash", "zmq", "zstandard",
    }
)  # fmt: skip
#: what the stand-ins answer where SGLang asks about the machine at import time: one B200 (CUDA, sm 10.0)
OVERRIDES: dict[str, Any] = {
    "torch.__version__": "2.14.1",
    "torch.cuda.is_available": lambda *a, **k: True,
    "torch.cuda.get_device_capability": lambda *a, **k: (10, 0),
    "torch.cuda.get_device_name": lambda *a, **k: "NVIDIA B200",
    "torch.cuda.device_count": lambda *a, **k: 1,
    "torch.version.hip": None,
    "torch.version.cuda": "12.9",
    "uvloop.EventLoopPolicy": asyncio.DefaultEventLoopPolicy,
}
#: accelerators SGLang detects with ``hasattr(torch, name)``: absent
ABSENT = {"torch": frozenset({"npu", "musa", "hpu", "mlu"})}
#: stand-in attributes callers use as text
TEXT_ATTRS = {"name": "standin", "__version__": "0.0.0"}
STUBBED: set[str] = set()


class _StandInMeta(abc.ABCMeta):
    """Metaclass of every stand-in: any attribute is another stand-in, calling one returns it (or, used as a
    decorator on a function, the function), and it is falsy, empty, zero and comparable."""

    def __new__(mcls, name, bases, namespace, **kwargs):
        return super().__new__(mcls, name, bases, namespace)

    def __getattr__(cls, name):
        return _attribute(cls, cls.__dict__.get("_qual", f"{cls.__module__}.{cls.__name__}"), name, type.__setattr__)

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_standin"):
            if len(args) == 1 and not kwargs and isinstance(args[0], types.FunctionType):
                return args[0]
            return cls
        return type.__call__(cls, *args, **kwargs)

    def register(cls, *args, **kwargs):  # AutoConfig.register(...) and ABC registration
        if cls.__dict__.get("_standin"):
            return args[0] if args else None
        return super().register(*args)

    def __getitem__(cls, item):
        return cls

    def __setitem__(cls, item, value):
        pass

    def __delitem__(cls, item):
        pass

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0

    def __bool__(cls):
        return False

    def __int__(cls):
        return 0

    def __index__(cls):
        return 0

    def __float__(cls):
        return 0.0

    def __contains__(cls, item):
        return False

    def __enter__(cls):
        return cls

    def __exit__(cls, *exc):
        return False

    def __lt__(cls, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(cls, other):
        return cls is other

    def __hash__(cls):
        return id(cls)

    def __mul__(cls, other):
        return cls

    __rmul__ = __add__ = __radd__ = __sub__ = __rsub__ = __truediv__ = __rtruediv__ = __mul__
    __pow__ = __rpow__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __matmul__ = __mul__
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __lshift__ = __rshift__ = __mul__

    def __neg__(cls):
        return cls

    __pos__ = __abs__ = __invert__ = __neg__


class _StandIn(metaclass=_StandInMeta):
    """Base of the stand-ins; classes SGLang derives from one (an ``nn.Module``) are real classes."""

    _standin = False

    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StandInMeta(name, (_StandIn,), {"_standin": True, "__module__": "standin"})

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name in ABSENT.get(self.__name__, ()):
            raise AttributeError(name)
        return _attribute(self, self.__name__, name, setattr)


def _attribute(owner: Any, qual: str, name: str, store) -> Any:
    full = f"{qual}.{name}"
    if full in OVERRIDES:
        value = OVERRIDES[full]
    elif name in TEXT_ATTRS:
        return TEXT_ATTRS[name]
    elif name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    else:
        value = _StandInMeta(name, (_StandIn,), {"_standin": True, "__module__": qual.split(".")[0], "_qual": full})
    store(owner, name, value)
    return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a :data:`HEAVY` module no installed package provides becomes a stand-in."""

    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".")[0]
        if root not in HEAVY:
            return None
        STUBBED.add(root)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = OVERRIDES.get(f"{spec.name}.__version__", "0.0.0")
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Stand-ins for missing heavy modules, and ``sglang`` as a bare package (its ``__init__`` not run)."""
    sys.meta_path.append(_StandInFinder())
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise SystemExit("sglang is not installed in this interpreter")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["sglang"] = package


def _safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def server_args(case: dict) -> dict:
    from sglang.srt.server_args import prepare_server_args

    argv = list(case["argv"])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            namespace = _parser().parse_args(argv)
    except (SystemExit, argparse.ArgumentError) as exc:
        said = [line for line in err.getvalue().splitlines() if "error:" in line]
        return {"error": (said[-1] if said else str(exc))[-1000:]}
    out: dict[str, Any] = {"namespace": _safe(vars(namespace))}
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            prepared = prepare_server_args(argv)
        fields = getattr(type(prepared), "__struct_fields__", None) or list(vars(prepared))
        out["prepared"] = _safe({name: getattr(prepared, name, None) for name in fields})
        if prepared.enable_deterministic_inference:
            out["deterministic"] = _deterministic(prepared)
    except BaseException as exc:
        out["prepare_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return out


def _deterministic(prepared: Any) -> dict:
    """What ``--enable-deterministic-inference`` resolves to at launch on the stand-in machine (one B200):
    SGLang's own ``handle_deterministic_inference`` run on the prepared ``ServerArgs``, read through its
    ``resolved_view`` (the launch applies these declarations; ``prepare_server_args`` alone does not)."""
    from sglang.srt.arg_groups.attention_hook import handle_deterministic_inference
    from sglang.srt.arg_groups.model_override_base import resolved_view

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        handle_deterministic_inference(prepared)
    view = resolved_view(prepared)
    return {name: getattr(view, name) for name in ("attention_backend", "sampling_backend", "disable_radix_cache")}


def chat_request(case: dict) -> dict:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    body = case["body"]
    names = set()
    for name, info in ChatCompletionRequest.model_fields.items():
        names |= {name, info.alias or name, info.validation_alias if isinstance(info.validation_alias, str) else name}
    unknown = sorted(set(body) - names)
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return {"error": str(exc)[:2000], "unknown": unknown}
    return {"unknown": unknown, "fields": _safe(request.model_dump(exclude_unset=True))}


def generate_request(case: dict) -> dict:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    body = case["body"]
    try:
        GenerateReqInput(**body)
        params = SamplingParams(**(body.get("sampling_params") or {}))
        params.verify(int(case["vocab_size"]))
    except (TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    return {"ok": True}


class _RecordingTokenizer:
    """Stands in for the model's tokenizer in :func:`chat_process`: records every ``apply_chat_template`` call
    (deep copies of what SGLang passes) and encodes any text as ``prompt_ids``."""

    chat_template = "{{ messages }}"
    bos_token_id = None  # no BOS to strip from an encoded continuation prefix

    def __init__(self, prompt_ids: list[int]):
        self.calls: list[dict[str, Any]] = []
        self.encoded: list[str] = []  # texts encoded besides the rendered prompt (a continuation's prefix)
        self.prompt_ids = list(prompt_ids)

    def apply_chat_template(self, messages, **kwargs):
        import copy

        self.calls.append({"messages": copy.deepcopy(messages), **copy.deepcopy(kwargs)})
        return "recorded prompt"

    def encode(self, text, **kwargs):
        if text == "recorded prompt":
            return list(self.prompt_ids)
        self.encoded.append(text)
        return [0] * len(text)  # one stand-in id per character

    def decode(self, ids, **kwargs):
        return "recorded prompt"


def _serving_chat(server_argv: list[str], chat_template: str | None, tokenizer: Any = None):
    """An ``OpenAIServingChat`` with what its ``__init__`` would set from ``server_argv`` and the served
    ``chat_template`` (a plain Jinja template, no tool-call parser unless the flags name one), without a model."""
    from collections import OrderedDict

    from sglang.srt.entrypoints.openai import serving_chat
    from sglang.srt.parser.template_detection import detect_reasoning_pattern
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import json_response

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        args = prepare_server_args(list(server_argv))
    # the serving config SGLang publishes at start-up (the model's own config would be read for the rest)
    serving_chat.get_serving = lambda: types.SimpleNamespace(
        return_input_ids=False,
        return_output_ids=False,
        enable_cache_report=args.enable_cache_report,
        default_chat_template_kwargs=None,
        trust_request_chat_template=False,
        allow_auto_truncate=args.allow_auto_truncate,
    )
    json_response.Response = lambda content, media_type: content  # the body starlette would send
    server = object.__new__(serving_chat.OpenAIServingChat)  # what __init__ sets that the code judged reads
    server.reasoning_parser = args.reasoning_parser
    server.tool_call_parser = args.tool_call_parser
    server.chat_encoding_spec = None
    server._encoding_adapter = None
    server._response_parser = None
    server._reasoning_detector = None
    server.default_chat_template_kwargs = {}
    server.default_sampling_params = {}
    server.allowed_custom_labels = None
    server.is_gpt_oss = server.is_gemma4 = server.is_minimax_m3 = False
    server._tokenizer_auto_adds_specials = False  # Qwen / SmolLM2 tokenizers add no BOS to encode("")
    server._prompt_text_round_trip_is_lossy = False  # a Hugging Face tokenizer's text round trip is exact
    server._template_reads_reasoning_content = True
    server._chat_template_cache = OrderedDict()
    # what SGLang's template manager detects in the served chat template (does it open the thinking, and with
    # which toggle), by SGLang's own rules; a Jinja template (no named conversation template), string content
    always_on, toggle = detect_reasoning_pattern(chat_template)
    server.template_manager = types.SimpleNamespace(
        force_reasoning=always_on,
        reasoning_config=toggle,
        chat_template_name=None,
        jinja_template_content_format="string",
        jinja_template_may_reorder_tool_results=False,
        python_chat_template=None,
    )
    model_config = types.SimpleNamespace(
        is_multimodal=False, hf_config=types.SimpleNamespace(architectures=["Qwen3ForCausalLM"])
    )
    server.tokenizer_manager = types.SimpleNamespace(
        tokenizer=tokenizer, model_config=model_config, served_model_name="judge"
    )
    return server, args


def chat_reply(case: dict) -> dict:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.utils import json_response

    server, args = _serving_chat(case["server_argv"], case.get("chat_template"))
    request = ChatCompletionRequest.model_validate(case["request"])
    output_ids = list(case["output_ids"])
    meta = {
        "id": "judge-0",
        "finish_reason": case["finish_reason"],
        "prompt_tokens": int(case["prompt_tokens"]),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": args.weight_version,
    }
    ret = [{"text": case["text"], "output_ids": output_ids, "meta_info": meta}]
    if case.get("prompt_token_ids") is not None:
        # what TokenizerManager puts beside the output when the request asked for prompt ids
        # (``state.prompt_token_ids``: the tokenized input, ``return_prompt_token_ids``)
        ret[0]["prompt_token_ids"] = list(case["prompt_token_ids"])
    response = server._build_chat_response(request, ret, 0)
    body = json_response.model_json_response(response)
    return {"body": body.decode() if isinstance(body, bytes) else body}


def generate_meta(case: dict) -> dict:
    from sglang.srt.managers import tokenizer_manager

    tokenizer_manager.get_spec = lambda: types.SimpleNamespace(speculative_num_draft_tokens=case["num_draft_tokens"])
    recv = types.SimpleNamespace(
        spec_verify_ct=[case["spec_verify_ct"]],
        spec_num_correct_drafts=[case["spec_num_correct_drafts"]],
        completion_tokens=[case["completion_tokens"]],
        spec_correct_drafts_histogram=[case.get("histogram") or []],
    )
    meta: dict[str, Any] = {}
    tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics(None, meta, recv, 0)
    return {"meta": _safe(meta)}


def chat_process(case: dict) -> dict:
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    tokenizer = _RecordingTokenizer(case.get("prompt_ids") or [1, 2, 3])
    server, _ = _serving_chat(case["server_argv"], case.get("chat_template"), tokenizer)
    try:
        request = ChatCompletionRequest.model_validate(case["body"])
    except ValidationError as exc:
        return {"error": str(exc)[:2000]}
    try:
        adapted, _ = server._convert_to_internal_request(request)
    except ValueError as exc:  # SGLang answers these with HTTP 400
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "template_calls": _safe(tokenizer.calls)}
    params = adapted.sampling_params
    return {
        "template_calls": _safe(tokenizer.calls),
        "encoded": tokenizer.encoded,
        "generate": {
            "input_ids": adapted.input_ids,
            "text": adapted.text,
            "return_prompt_token_ids": adapted.return_prompt_token_ids,
            "sampling_params": _safe(params if isinstance(params, dict) else vars(params)),
        },
    }


def length_check(case: dict) -> dict:
    """SGLang's own length rule (``TokenizerManager._validate_one_request``) on a prompt of ``prompt_tokens`` ids
    and ``max_new_tokens``, under ``--context-length`` ``context_length`` (no EAGLE: no reserved tokens; no
    ``--allow-auto-truncate``): ``{"ok": true}`` or ``error``, the ValueError SGLang answers with HTTP 400."""
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.io_struct import GenerateReqInput

    tokenizer_manager.get_exec = lambda: types.SimpleNamespace(
        features=types.SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    )
    manager = types.SimpleNamespace(
        context_len=int(case["context_length"]),
        num_reserved_tokens=0,
        allow_auto_truncate=False,
        validate_total_tokens=True,
        is_generation=True,
        _validate_joint_schema_request=lambda obj, input_ids: None,
        _validate_token_ids_logprob=_past_the_length_rule,  # what the function checks next: other fields
    )
    ids = [1] * int(case["prompt_tokens"])
    request = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": int(case["max_new_tokens"])})
    try:
        tokenizer_manager.TokenizerManager._validate_one_request(manager, request, ids)
    except ValueError as exc:
        return {"error": str(exc)[:500]}
    except _Stop:
        return {"ok": True}
    return {"crash": "the length rule was not reached"}


def _past_the_length_rule(obj: Any) -> None:
    raise _Stop


class _Stop(Exception):
    """Raised where the code judged has done what is judged: ``sglang_router.launch_server.main`` is about to start
    processes (:func:`router_args`), ``_validate_one_request`` is past its length rule (:func:`length_check`)."""


def router_args(case: dict) -> dict:
    import multiprocessing

    from sglang.srt.server_args import ServerArgs
    from sglang_router import launch_server
    from sglang_router.router_args import RouterArgs

    made: dict[str, Any] = {}
    server_from, router_from = ServerArgs.from_cli_args.__func__, RouterArgs.from_cli_args.__func__

    def server(cls, args):
        made["server"], made["worker_base_port"] = server_from(cls, args), args.router_dp_worker_base_port
        return made["server"]

    def router(cls, args, use_router_prefix=False):
        made["router"] = router_from(cls, args, use_router_prefix)
        return made["router"]

    def stop(*args, **kwargs):
        raise _Stop

    ServerArgs.from_cli_args, RouterArgs.from_cli_args = classmethod(server), classmethod(router)
    launch_server.find_available_ports = stop  # the first thing main does after parsing: pick worker ports
    multiprocessing.set_start_method = lambda *args, **kwargs: None  # main sets "spawn"; once per process
    sys.argv = ["sglang_router.launch_server", *case["argv"]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            launch_server.main()
    except _Stop:
        pass
    except SystemExit as exc:
        said = [line for line in err.getvalue().splitlines() if "error:" in line]
        return {"error": (said[-1] if said else f"exit {exc.code}")[-1000:]}
    finally:
        ServerArgs.from_cli_args, RouterArgs.from_cli_args = classmethod(server_from), classmethod(router_from)

    def fields(obj: Any) -> dict:
        names = getattr(type(obj), "__struct_fields__", None) or [f.name for f in dataclasses.fields(obj)]
        return _safe({name: getattr(obj, name, None) for name in names})

    return {
        "server": fields(made["server"]),
        "router": fields(made["router"]),
        "worker_base_port": made["worker_base_port"],
    }


OPS = {
    "server_args": server_args,
    "chat_process": chat_process,
    "router_args": router_args,
    "length_check": length_check,
    "chat_request": chat_request,
    "generate_request": generate_request,
    "chat_reply": chat_reply,
    "generate_meta": generate_meta,
}


def main() -> None:
    """Judge every case of the JSON list on stdin; print the JSON list of results (each with ``stubbed``)."""
    install()
    results = []
    for case in json.load(sys.stdin):
        try:
            result = OPS[case["op"]](case)
        except Exception as exc:
            result = {"crash": f"{type(exc).__name__}: {exc}"[:2000]}
        results.append({**result, "stubbed": sorted(STUBBED)})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
