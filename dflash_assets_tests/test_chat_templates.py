"""Tool conversations from a corpus row to the tokens it trains on (issue 43, items 3 and 4): the shipped SmolLM2
template and the Qwen3.6 stand-in's render tools, ``target_model.chat_template`` reaches tokenization and the
servers, a target that cannot render tools is refused before any request, request bodies carry the row's tools,
the prompt-ids check names the row and token where the rendering parts from the server's, and a conversation's
turns prefer one server."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from transformers import AutoTokenizer

from dflash_assets.common.conversation import stored_message
from dflash_assets.common.settings import GenerationSettings
from dflash_assets.data.tokenization import SequenceBuilder, TokenizePolicy, tokenize_partition
from dflash_assets.generation.client.completion_client import CompletionClient
from dflash_assets.generation.engines.chat_render import (
    BUNDLED_TEMPLATES,
    SMOLLM2_TOOLS_TEMPLATE,
    ChatTemplateError,
    PromptTokensMismatch,
    check_renders_tools,
    first_difference,
    uses_tools,
)
from dflash_assets.generation.engines.hybrid_standin import CHAT_TEMPLATE as STANDIN_TEMPLATE
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.range_plan import RangeRunError
from dflash_assets.generation.rows.records import rows_to_frame
from dflash_assets.generation.servers.pool import ServerPool
from dflash_assets.generation.servers.transformers_server import model_dir_with_template
from dflash_assets.stages.completions.continuing import check_tool_rendering
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_simulators.behaviours import Reply
from dflash_simulators.stand_in_server import FakeServer

SHIPPED = BUNDLED_TEMPLATES / SMOLLM2_TOOLS_TEMPLATE
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# the stand-in's template before it rendered tools: plain conversations must render as they did
OLD_STANDIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}}
# a conversation as the corpus stores it: every field present (nulls), tool_calls as JSON text
STORED = [
    stored_message({"role": "user", "content": "Weather in Paris?"}),
    stored_message({"role": "assistant", "content": "", "tool_calls": [CALL]}),
    stored_message({"role": "tool", "content": "sunny, 21C", "tool_call_id": "c1", "name": "get_weather"}),
]
PLAIN = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"}],
    [{"role": "user", "content": " x\n"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return ensure_local_model()


@pytest.fixture(scope="module")
def smol(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir)


def render(tok, messages, template, tools=None, **kwargs) -> str:
    extra = {"tools": tools} if tools else {}
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template, **extra, **kwargs
    )


# ------------------------------------------------------------------------------ the templates


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_shipped_template_renders_plain_conversations_as_smollm2s_own(smol, generation_prompt):
    """Stored rows without tools stay valid: the shipped file renders them byte for byte as SmolLM2's template."""
    shipped = SHIPPED.read_text()
    for messages in PLAIN:
        own = smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        mine = smol.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=shipped
        )
        assert mine == own
    assert DEFAULT_SYSTEM in smol.chat_template  # the default system prompt is the model's own


def test_shipped_template_renders_tools_calls_and_results(smol):
    builder = SequenceBuilder(smol)
    smol_with = AutoTokenizer.from_pretrained(smol.name_or_path)
    smol_with.chat_template = SHIPPED.read_text()
    text = SequenceBuilder(smol_with).prompt_text(STORED, True, json.dumps(TOOLS))
    schema = (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
    )
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{schema}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    # a server that dumps the schema with null fields (vLLM keeps description: null) renders the same text
    bare = [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]
    assert '{"name": "f"}}' in render(smol_with, [{"role": "user", "content": "q"}], None, bare)
    assert builder.prompt_text(PLAIN[0], True) == render(smol, PLAIN[0], None)


def test_standin_template_renders_tools_as_qwen36_does(smol):
    for messages in PLAIN:
        for thinking in (True, False):
            old = render(smol, messages, OLD_STANDIN_TEMPLATE, enable_thinking=thinking)
            assert render(smol, messages, STANDIN_TEMPLATE, enable_thinking=thinking) == old
    stored = [stored_message({"role": "system", "content": "Be terse."}), *(dict(m) for m in STORED)]
    stored[2]["reasoning_content"] = "I need the weather tool."
    stored[2]["content"] = "Checking."
    smol_standin = AutoTokenizer.from_pretrained(smol.name_or_path)
    smol_standin.chat_template = STANDIN_TEMPLATE
    text = SequenceBuilder(smol_standin).prompt_text(stored, True, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert "<function=example_function_name>" in text and text.count("<|im_start|>system") == 1
    assert "</IMPORTANT>\n\nBe terse.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<think>\nI need the weather tool.\n</think>\n\nChecking.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in text
    check_renders_tools(smol_standin, "the stand-in")


def test_a_template_without_tools_is_refused_naming_the_key(smol):
    with pytest.raises(ChatTemplateError, match=r"function name, a tool call's arguments.*target_model.chat_template"):
        check_renders_tools(smol, "SmolLM2")
    broken = AutoTokenizer.from_pretrained(smol.name_or_path)
    broken.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ChatTemplateError, match=r"fails on them.*target_model.chat_template"):
        check_renders_tools(broken, "a raising template")


def test_uses_tools_finds_every_kind_of_tool_row():
    assert not uses_tools([stored_message({"role": "user", "content": "q"})], None)
    assert not uses_tools([{"role": "user", "content": "q"}], "[]")
    assert uses_tools([{"role": "user", "content": "q"}], json.dumps(TOOLS))
    assert uses_tools(STORED[:2], None) and uses_tools(STORED[2:], None)


# ------------------------------------------------------------------------------ target_model.chat_template


def test_chat_template_key_reaches_the_tokenizer_and_bad_files_name_key_and_path(tmp_path, smol):
    shipped = TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE)  # a shipped template by its name
    assert shipped.chat_template_path() == SHIPPED.resolve()
    assert shipped.load_tokenizer().chat_template == SHIPPED.read_text()
    assert TargetModelResource().load_tokenizer().chat_template == smol.chat_template
    missing = tmp_path / "nope.jinja"
    with pytest.raises(ChatTemplateError, match=rf"target_model.chat_template is '{missing}': no such file"):
        TargetModelResource(chat_template=str(missing)).load_tokenizer()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=rf"target_model.chat_template: {bad} is not valid Jinja"):
        TargetModelResource(chat_template=str(bad)).load_tokenizer()
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ChatTemplateError, match=rf"cannot read {bad}"):
        TargetModelResource(chat_template=str(bad)).chat_template_text()


def test_servers_are_started_with_the_template(tmp_path, smol_dir):
    inference = InferenceServerResource(mode="vllm")
    argv = inference.vllm_commands("/env/bin/python", port_base=8100, chat_template=SHIPPED)[0].argv
    assert argv[argv.index("--chat-template") + 1] == str(SHIPPED)
    assert "--chat-template" not in inference.vllm_commands("/env/bin/python", port_base=8100)[0].argv
    sglang = InferenceServerResource(mode="sglang", sglang={"model_path": str(smol_dir)})
    argv = sglang.sglang_commands(chat_template=SHIPPED)[0].argv
    assert argv[argv.index("--chat-template") + 1] == str(SHIPPED)
    # transformers serve has no flag: it serves a directory whose tokenizer renders with the file
    served = model_dir_with_template(smol_dir, SHIPPED)
    try:
        assert AutoTokenizer.from_pretrained(served).chat_template == SHIPPED.read_text()
        assert (served / "model.safetensors").resolve() == (smol_dir / "model.safetensors").resolve()
    finally:
        import shutil

        shutil.rmtree(served)


# ------------------------------------------------------------------------------ plan-time check


def corpus_rows(with_tools: bool) -> list[dict]:
    plain = {"index": 0, "messages": [stored_message({"role": "user", "content": "q"})], "tools": None}
    tooled = {"index": 7, "messages": STORED, "tools": json.dumps(TOOLS)}
    return [plain, tooled] if with_tools else [plain]


def test_plan_time_check_refuses_a_template_without_tools_before_any_request():
    inference = InferenceServerResource(mode="vllm")  # the embedded SmolLM2 model, its own template
    assert check_tool_rendering(inference, None, corpus_rows(False)) is None  # plain corpora: nothing loaded
    with pytest.raises(RangeRunError, match=r"row 7: .*does not render .*set resources.target_model.chat_template"):
        check_tool_rendering(inference, None, corpus_rows(True))
    builder = check_tool_rendering(inference, SHIPPED, corpus_rows(True))
    assert builder.tokenizer.chat_template == SHIPPED.read_text()
    parsed = InferenceServerResource(mode="vllm", vllm={"extra_args": ["--tool-call-parser=hermes"]})
    with pytest.raises(RangeRunError, match=r"row 7 and others use tools.*holds --tool-call-parser"):
        check_tool_rendering(parsed, SHIPPED, corpus_rows(True))


# ------------------------------------------------------------------------------ request bodies


def test_request_bodies_carry_api_messages_and_tools():
    settings = GenerationSettings()
    body = settings.request_body("m", STORED, 3, json.dumps(TOOLS))
    assert body["tools"] == TOOLS and body["tool_choice"] == "none"
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},  # arguments stay JSON text (OpenAI's shape)
        {"role": "tool", "content": "sunny, 21C", "tool_call_id": "c1", "name": "get_weather"},
    ]
    plain = settings.request_body("m", [stored_message({"role": "user", "content": "q"})], tools="[]")
    assert plain["messages"] == [{"role": "user", "content": "q"}]  # as before tools were stored
    assert "tools" not in plain and "tool_choice" not in plain


def test_each_engine_gets_the_tool_choice_that_renders_tools_and_parses_nothing():
    body = GenerationSettings().request_body("m", STORED, 0, TOOLS)
    body["messages"][1]["reasoning_content"] = "think"
    assert ServerPool(["u"], "m", backend="vllm").adapt_body(body)["tool_choice"] == "none"
    vllm = ServerPool(["u"], "m", backend="vllm").adapt_body(body)
    assert vllm["messages"][1]["reasoning"] == "think" and vllm["return_token_ids"] is True
    assert ServerPool(["u"], "m", backend="sglang").adapt_body(body)["tool_choice"] == "auto"
    local = ServerPool(["u"], "m", backend="transformers").adapt_body(body)
    assert "tool_choice" not in local and local["tools"] == TOOLS
    assert local["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == CALL["function"]["arguments"]


def test_turns_of_one_conversation_prefer_one_server():
    urls = [f"http://127.0.0.1:{9000 + k}/v1" for k in range(3)]
    first, again = CompletionClient(urls), CompletionClient(list(urls))
    chosen = {c: first.route_server(c) for c in (f"conv-{k}" for k in range(60))}
    assert chosen == {c: again.route_server(c) for c in chosen}  # stable across clients (runs)
    assert set(chosen.values()) == {u.rstrip("/") for u in urls}  # and spread over all servers
    # through real sockets: every turn of a conversation lands on the server its id names
    with FakeServer(Reply()) as one, FakeServer(Reply()) as two:
        client = CompletionClient([one.url, two.url], concurrency=4)
        items = [
            (k, {"model": "m", "messages": [{"role": "user", "content": str(k)}]}, f"conv-{k % 5}") for k in range(20)
        ]
        results = []
        client.generate_blocking(items, results.append)
    servers = {r.index: r.server for r in results}
    assert len(servers) == 20 and all(r.error is None for r in results)
    for k in range(20):
        assert servers[k] == client.route_server(f"conv-{k % 5}")
    assert len(set(servers.values())) == 2


# ------------------------------------------------------------------------------ the prompt-ids check


def completion_row(index: int, prompt_ids: list[int] | None) -> dict:
    settings = GenerationSettings(max_output_tokens=64)
    return {
        "index": index,
        "prompt_id": f"t:{index}",
        "prompt_hash": f"h{index}",
        "source": "t",
        "content": "It is sunny.",
        "finish_reason": "stop",
        "prompt_tokens": len(prompt_ids or []),
        "completion_tokens": 4,
        "max_output_tokens": 64,
        "settings_fingerprint": settings.sampling_fingerprint(),
        "settings": settings.settings_json,
        "prompt_token_ids": prompt_ids,
    }


def test_prompt_ids_check_names_the_row_and_token_where_rendering_parts(smol):
    tok = AutoTokenizer.from_pretrained(smol.name_or_path)
    tok.chat_template = SHIPPED.read_text()
    conversations = {3: STORED, 4: [stored_message({"role": "user", "content": "plain"})]}
    tools = {3: json.dumps(TOOLS), 4: None}
    corpus = pl.DataFrame(
        {
            "index": list(conversations),
            "prompt_id": [f"t:{i}" for i in conversations],
            "messages": list(conversations.values()),
            "tools": list(tools.values()),
            "content_hash": [f"h{i}" for i in conversations],
        }
    )
    # the server's ids, computed apart: the conversations as vLLM hands them to the template (arguments parsed)
    parsed_call = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    api = {
        3: [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [parsed_call]},
            {"role": "tool", "content": "sunny, 21C", "tool_call_id": "c1", "name": "get_weather"},
        ],
        4: [{"role": "user", "content": "plain"}],
    }
    server = {
        i: tok.apply_chat_template(
            api[i], tools=TOOLS if tools[i] else None, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for i in api
    }
    builder, policy = SequenceBuilder(tok), TokenizePolicy()
    rows = [completion_row(3, server[3]), completion_row(4, server[4])]
    out, _, counts = tokenize_partition(rows_to_frame(rows), corpus, builder, policy)
    assert counts["prompt_ids_checked"] == 2 and counts["kept"] == 2
    for r in out.iter_rows(named=True):  # loss only on the regenerated turn: the context carries none
        assert r["input_ids"][: r["prompt_len"]] == server[r["index"]]
        assert r["loss_mask"] == [0] * len(server[r["index"]]) + [1] * (len(r["input_ids"]) - r["prompt_len"])
    at = len(server[3]) - 9
    parted = [*server[3][:at], server[3][at] + 1, *server[3][at + 1 :]]
    rows = [completion_row(3, parted), completion_row(4, None)]
    with pytest.raises(PromptTokensMismatch, match=rf"row 3 \(prompt_id t:3\).* at token {at} of "):
        tokenize_partition(rows_to_frame(rows), corpus, builder, policy)
    rows = [completion_row(3, None), completion_row(4, server[4][:-1])]  # the server's ids stop short
    with pytest.raises(PromptTokensMismatch, match=rf"row 4 .* at token {len(server[4]) - 1} .*server '?\(ends here"):
        tokenize_partition(rows_to_frame(rows), corpus, builder, policy)
    out, _, counts = tokenize_partition(rows_to_frame([completion_row(4, None)]), corpus, builder, policy)
    assert "prompt_ids_checked" not in counts and counts["kept"] == 1  # no ids from the server: nothing to check
    # an old corpus without a tools column tokenizes as before
    plain = tokenize_partition(rows_to_frame([completion_row(4, server[4])]), corpus.drop("tools"), builder, policy)
    assert plain[2]["prompt_ids_checked"] == 1


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_shipped_templates_and_configs_are_package_data():
    """The wheel carries the bundled configs and templates (setuptools packs no data file it is not told of)."""
    import tomllib

    package = BUNDLED_TEMPLATES.parents[1]
    globs = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = {p for pattern in globs["dflash_assets"] for p in package.glob(pattern)}
    assert SHIPPED in data and package / "configs" / "local_demo.yaml" in data
    assert set(BUNDLED_TEMPLATES.iterdir()) <= data
