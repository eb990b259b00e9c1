"""On-policy BFCL trajectories through a real server (issue 43 item 5, "Done when"): vLLM's CPU build serves the
embedded SmolLM2 model with the shipped tools template, and ``completions`` with ``mode: on_policy`` runs two
training tasks of ``bfcl:multi_turn_base`` with it as the assistant; then ``tokenized_sequences``,
``hidden_states`` (the same SmolLM2 as the target) and a few ``dflash_drafter`` steps train on those turns.

SmolLM2 emits no tool call on a fresh BFCL context (measured on this server, greedy and at temperature 1, with
and without a system prompt asking for calls: 0 of 12 first turns), so the first reply of each conversation is
scripted: a stand-in proxy in its own process answers the first request of a conversation with a Hermes tool-call
reply (good calls in one, bad ones in the other) and forwards every other request, unchanged, to the real server.
It also logs every request it receives (the server's side of the wire, which a killed run cannot lose). Every
later turn is the real model's, conditioned on the calls and their executed results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from dflash_assets.assets.completions import completions
from dflash_assets.assets.drafter import dflash_drafter
from dflash_assets.assets.hidden_states import hidden_states
from dflash_assets.assets.prompts import prompt_corpus
from dflash_assets.assets.tokenized import tokenized_sequences
from dflash_assets.data.bfcl import ToolEnvironment, load_tasks
from dflash_assets.data.on_policy import TURN_STRIDE
from dflash_assets.dflash.shards.format import read_shard
from dflash_assets.generation.engines.chat_render import SMOLLM2_TOOLS_TEMPLATE
from dflash_assets.generation.engines.local_model import ensure_local_model
from dflash_assets.generation.rows.journal import RowJournal
from dflash_assets.orchestration import freshness
from dflash_assets.orchestration.partitions import prompt_ranges
from dflash_assets.stages.completions.continuing import load_target_builder
from dflash_assets.stages.completions.on_policy import journal_name, table_file
from dflash_assets.stages.resources.generation import GenerationResource
from dflash_assets.stages.resources.inference import InferenceServerResource
from dflash_assets.stages.resources.storage import StorageResource
from dflash_assets.stages.resources.target_model import TargetModelResource
from dflash_assets.stages.tokenized import tokenized_file
from dflash_assets_tests.script_server import script_server

CAP = 24
SOURCE = "bfcl:multi_turn_base?limit=2&tools=used"  # training tasks multi_turn_base_0 and _1, 4 user turns each
CONTEXT = 4096


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


GOOD = {  # task 0: "Move 'final_report.pdf' within document directory to 'temp' directory in document. ..."
    "task": "multi_turn_base_0",
    "content": "\n".join(
        [
            tool_call("cd", {"folder": "document"}),
            tool_call("mkdir", {"dir_name": "temp"}),
            tool_call("mv", {"source": "final_report.pdf", "destination": "temp"}),
        ]
    ),
}
BAD = {  # task 1: a call that is not JSON, an unknown function, a wrong parameter, one cut before its end
    "task": "multi_turn_base_1",
    "content": '<tool_call>\n{"name": "ls", "arguments": {"a": }\n</tool_call>\n'
    + tool_call("rm_everything", {})
    + "\n"
    + tool_call("cd", {"no_such_parameter": 1})
    + '\n<tool_call>\n{"name": "tail"',
}

PROXY = textwrap.dedent(
    """
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import httpx

    config = json.load(open({config!r}))
    upstream = httpx.Client(base_url=config["upstream"], timeout=600)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, status, body, content_type="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self.send(200, b"{{}}")
            reply = upstream.get(self.path)
            self.send(reply.status_code, reply.content)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw)
            messages = body.get("messages") or []
            first = messages[0].get("content") if len(messages) == 1 and body.get("tools") else None
            scripted = config["scripted"].get(first)
            with open(config["log"], "a") as log:
                entry = {{"messages": messages, "tools": "tools" in body, "scripted": scripted is not None}}
                log.write(json.dumps(entry) + "\\n")
            if scripted is not None:
                reply = {{
                    "choices": [{{"index": 0, "finish_reason": "stop", "token_ids": scripted["token_ids"],
                                 "message": {{"role": "assistant", "content": scripted["content"]}}}}],
                    "usage": {{"prompt_tokens": 1, "completion_tokens": len(scripted["token_ids"])}},
                }}
                return self.send(200, json.dumps(reply).encode())
            reply = upstream.post(self.path, content=raw, headers={{"Content-Type": "application/json"}})
            self.send(reply.status_code, reply.content)

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)

STAGE = textwrap.dedent(
    """
    import logging, sys
    from dflash_assets.stages.completions.config import CompletionsConfig
    from dflash_assets.stages.completions.on_policy import OnPolicyRun
    from dflash_assets.stages.completions.tables import load_range_prompts
    from dflash_assets.stages.resources.generation import GenerationResource
    from dflash_assets.stages.resources.inference import InferenceServerResource
    from dflash_assets.stages.resources.storage import StorageResource
    from dflash_assets.stages.resources.target_model import TargetModelResource

    root, url, model, tokenizer, pk = sys.argv[1:]
    logging.basicConfig(level=logging.INFO)
    storage = StorageResource(root=root)
    inference = InferenceServerResource(mode="external", max_running_requests=4, external={{
        "base_urls": [url], "served_model_name": model, "backend": "vllm", "tokenizer_path": tokenizer,
        "context_length": {context}}})
    target = TargetModelResource(chat_template="{template}")
    settings = GenerationResource(max_output_tokens={cap}, temperature=0.0).settings()
    settings = settings.with_template(target.chat_template_text())  # as the asset stamps its rows
    store = storage.open()
    run = OnPolicyRun(logging.getLogger("stage"), store, settings, [pk], CompletionsConfig(mode="on_policy"),
                      chat_template=target.chat_template_path())
    for event in run.run(load_range_prompts(store, [pk]), storage, inference):
        print(event.pk, event.failure or "committed", flush=True)
    """
)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """``(base_url, served model name)`` of one real vLLM CPU server for the module (SmolLM2, tools template)."""
    inference = InferenceServerResource(mode="vllm", max_running_requests=4, vllm={"max_model_len": CONTEXT})
    template = TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE).chat_template_path()
    with inference.serve(log_dir=tmp_path_factory.mktemp("vllm_logs"), chat_template=template) as pool:
        yield pool.base_urls[0], pool.model


def tasks() -> dict:
    return {t.id: t for t in load_tasks()}


def proxy_source(tmp_path: Path, upstream: str, scripted: list[dict]) -> tuple[str, Path]:
    """The proxy script answering the first turn of each ``scripted`` task with its content, and its log."""
    builder = load_target_builder(InferenceServerResource(mode="vllm"))
    end = builder.end_token_id
    by_first = {
        tasks()[s["task"]].turns[0][0]["content"]: {
            "content": s["content"],
            "token_ids": builder.tokenizer(s["content"], add_special_tokens=False)["input_ids"] + [end],
        }
        for s in scripted
    }
    log = tmp_path / "requests.jsonl"
    config = tmp_path / "proxy.json"
    config.write_text(json.dumps({"upstream": upstream.removesuffix("/v1"), "log": str(log), "scripted": by_first}))
    return PROXY.format(config=str(config)), log


def resources(root: Path, url: str, model: str) -> dict:
    return {
        "storage": StorageResource(root=str(root)),
        "inference": InferenceServerResource(
            mode="external",
            max_running_requests=4,
            external={
                "base_urls": [url],
                "served_model_name": model,
                "backend": "vllm",
                "tokenizer_path": str(ensure_local_model()),
                "context_length": CONTEXT,
            },
        ),
        "generation": GenerationResource(max_output_tokens=CAP, temperature=0.0),
        "target_model": TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE),
    }


def build_corpus(instance, res) -> str:
    run_config = {"ops": {"prompt_corpus": {"config": {"sources": [SOURCE], "partition_size": 64}}}}
    assert dg.materialize([prompt_corpus], instance=instance, resources=res, run_config=run_config).success
    (pk,) = instance.get_dynamic_partitions(prompt_ranges.name)
    return pk


ON_POLICY = {"ops": {"completions": {"config": {"mode": "on_policy", "max_rounds_per_user_turn": 3}}}}


def requests(log: Path) -> list[dict]:
    """The chat requests the proxy received for conversations (with tools: not the servers' probe), in order."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [entry for entry in map(json.loads, lines) if entry["tools"]]


def blocks(text: str) -> list[str]:
    """The raw text of each ``<tool_call>`` block of a reply (to its end when never closed): read here, apart
    from the module under test."""
    return [part.split("</tool_call>")[0] for part in text.split("<tool_call>")[1:]]


def expected_conversation(rows: list[dict], max_rounds: int) -> None:
    """Walk one conversation's rows as the trajectory rule says, with a fresh environment executing the calls:
    each row's context is the one before plus its reply, the calls' results (or errors), then the next user
    turn when it called nothing or after ``max_rounds`` replies; the last row answers the task's last turn."""
    task = tasks()[rows[0]["conversation_id"].split(":", 1)[1]]
    env = ToolEnvironment(task)
    messages, user_turn, rounds = list(task.turns[0]), 0, 0
    for turn, row in enumerate(rows):
        assert row["turn"] == turn and json.loads(row["messages"]) == messages
        reply = json.loads(row["reply"])
        assert reply == {"role": "assistant", "content": reply["content"]}  # the text as generated, nothing parsed
        results = []
        for raw in blocks(reply["content"]):
            try:
                call = json.loads(raw)
                results.append(env.call(call["name"], call.get("arguments") or {}))
            except (ValueError, KeyError, TypeError):
                results.append(None)  # unreadable: an error result, whatever its words
        got = [m["content"] for m in json.loads(row["tool_messages"])]
        assert len(got) == len(results)
        for mine, theirs in zip(results, got):
            assert theirs == mine if mine is not None else '"error"' in theirs
        messages += [reply, *json.loads(row["tool_messages"])]
        rounds += 1
        if not results or rounds >= max_rounds:
            user_turn, rounds = user_turn + 1, 0
            if user_turn < len(task.turns):
                messages += task.turns[user_turn]
    assert user_turn == len(task.turns), "the conversation ended before the task's last user turn was answered"


def check_rows_train_on_what_was_sampled(rows: list[dict]) -> int:
    """Every row's context renders to the server's prompt_token_ids, and the loss covers exactly its own output
    ids (plus the end token of a stopped turn). Returns the rows whose ids the server gave."""
    builder = load_target_builder(InferenceServerResource(mode="vllm"), resources_template())
    built = builder.build_many(rows, [json.loads(r["messages"]) for r in rows], [r["tools"] for r in rows])
    compared = 0
    for row, (input_ids, prompt_len) in zip(rows, built, strict=True):
        ids = list(row["output_token_ids"])
        if row["finish_reason"] == "stop" and ids[-1] != builder.end_token_id:
            ids.append(builder.end_token_id)
        assert input_ids[prompt_len:] == ids
        if row["prompt_token_ids"] is not None:
            assert input_ids[:prompt_len] == list(row["prompt_token_ids"])
            compared += 1
    return compared


def resources_template():
    return TargetModelResource(chat_template=SMOLLM2_TOOLS_TEMPLATE).chat_template_path()


DRAFTER = {  # a few steps of a one-layer drafter on the stored features: that the turns train, not how well
    "ops": {
        "dflash_drafter": {
            "config": {
                "features": "offline",
                "num_hidden_layers": 1,
                "block_size": 4,
                "max_steps": 2,
                "max_anchors": 4,
                "eval_fraction": 0.0,
                "checkpoint_every": 0,
                "intermediate_size": 64,
            }
        }
    }
}


def test_calls_are_executed_answered_and_every_turn_is_a_row(vllm, tmp_path):
    source, log = proxy_source(tmp_path, vllm[0], [GOOD, BAD])
    root = tmp_path / "data"
    with script_server(source) as url, dg.instance_for_test() as instance:
        res = resources(root, url + "/v1", vllm[1])
        pk = build_corpus(instance, res)
        result = dg.materialize([completions], instance=instance, resources=res, partition_key=pk, run_config=ON_POLICY)
        assert result.success
        metadata = result.asset_materializations_for_node("completions")[0].metadata
        # the turns train: tokenized from the on-policy table, their features stored, a drafter trained on them
        keep = {"ops": {"tokenized_sequences": {"config": {"truncated": "keep"}}}}  # turns the cap cut train too
        stages = dg.materialize(
            [tokenized_sequences, hidden_states], instance=instance, resources=res, partition_key=pk, run_config=keep
        )
        assert stages.success
        evaluations = stages.get_asset_check_evaluations()
        assert evaluations and all(e.passed for e in evaluations), [e for e in evaluations if not e.passed]
        tokenized_meta = stages.asset_materializations_for_node("tokenized_sequences")[0].metadata
        hidden_meta = stages.asset_materializations_for_node("hidden_states")[0].metadata
        trained = dg.materialize([dflash_drafter], instance=instance, resources=res, run_config=DRAFTER)
        assert trained.success
        drafter_meta = trained.asset_materializations_for_node("dflash_drafter")[0].metadata
    check_turns_tokenized_and_trained(root, pk, tokenized_meta, hidden_meta, drafter_meta)
    frame = pl.read_parquet(root.joinpath(*table_file(pk)))
    rows = frame.sort("index").to_dicts()
    sent = requests(log)
    assert len(rows) == len(sent)  # one row per request, one request per assistant turn
    for cid in frame["conversation_id"].unique().to_list():
        expected_conversation([r for r in rows if r["conversation_id"] == cid], max_rounds=3)
    good, bad = (next(r for r in rows if r["conversation_id"].endswith(s["task"])) for s in (GOOD, BAD))
    # the good calls: executed on the task's tools in order; the next request carries their results
    env = ToolEnvironment(tasks()[GOOD["task"]])
    results = [
        env.call("cd", {"folder": "document"}),
        env.call("mkdir", {"dir_name": "temp"}),
        env.call("mv", {"source": "final_report.pdf", "destination": "temp"}),
    ]
    assert [m["content"] for m in json.loads(good["tool_messages"])] == results and "error" not in "".join(results)
    after = next(r for r in sent if len(r["messages"]) > 1 and r["messages"][0] == json.loads(good["messages"])[0])
    assert after["messages"][1] == {"role": "assistant", "content": GOOD["content"]}
    assert [m["content"] for m in after["messages"][2:5]] == results
    # the bad ones: each an error result in the conversation, and the run went on to the task's end
    errors = [json.loads(m["content"])["error"] for m in json.loads(bad["tool_messages"])]
    assert len(errors) == 4 and "unknown function 'rm_everything'" in errors[1] and "not closed" in errors[3]
    assert metadata["tool_error_results"].value >= 4 and metadata["tool_calls"].value >= 7
    # the real model's turns: exact ids, context = the server's prompt ids, loss on its own tokens only
    real = [r for r in rows if r["output_token_ids_source"] == "token_ids" and r["prompt_token_ids"] is not None]
    assert len(real) == len(rows) - 2 and metadata["prompt_ids_checked"].value == len(real)
    assert check_rows_train_on_what_was_sampled(rows) == len(real)
    after_tool = [r for r in rows if r["turn_kind"] == "after_tool"]
    assert after_tool and all(r["prompt_token_ids"] is not None for r in after_tool)


def test_kill_9_mid_conversation_then_rerun_keeps_every_finished_turn_and_resends_none(vllm, tmp_path):
    source, log = proxy_source(tmp_path, vllm[0], [])  # the real model alone: its trajectories end at its answers
    root = tmp_path / "data"
    with script_server(source) as url, dg.instance_for_test() as instance:
        res = resources(root, url + "/v1", vllm[1])
        pk = build_corpus(instance, res)
        journal = root / "completions" / journal_name(pk)
        script = STAGE.format(context=CONTEXT, cap=CAP, template=SMOLLM2_TOOLS_TEMPLATE)
        argv = [sys.executable, "-c", script, str(root), url + "/v1", vllm[1], str(ensure_local_model()), pk]
        stage = subprocess.Popen(argv, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 240
        while not (journal.exists() and journal.read_text().count("\n") >= 1):
            assert stage.poll() is None and time.monotonic() < deadline, "the stage ended before a turn was journaled"
            time.sleep(0.02)
        os.kill(stage.pid, signal.SIGKILL)
        stage.wait()
        finished = list(RowJournal(journal).load().values())  # a line the kill tore is no finished turn
        sent_before = len(requests(log))
        assert not root.joinpath(*table_file(pk)).exists()
        result = dg.materialize([completions], instance=instance, resources=res, partition_key=pk, run_config=ON_POLICY)
        assert result.success
        metadata = result.asset_materializations_for_node("completions")[0].metadata
        # judged as any completions partition: up to date for this corpus and these settings, stale under others
        template = res["target_model"].chat_template_text()
        settings = res["generation"].settings().with_template(template)
        assert freshness.completions_reasons(instance, [pk], settings) == {pk: None}
        hotter = GenerationResource(max_output_tokens=CAP, temperature=0.7).settings().with_template(template)
        assert freshness.completions_reasons(instance, [pk], hotter) == {pk: "sampling or chat template changed"}
        # its output is the on-policy table (no completions/<pk>.parquet): `run` in this mode has nothing to redo,
        # and in the other mode makes the partition again
        store = res["storage"].open()
        on_policy = freshness.partition_reasons(instance, "completions", [pk], settings, store=store, mode="on_policy")
        assert on_policy == {pk: None}
        regenerate = freshness.partition_reasons(
            instance, "completions", [pk], settings, store=store, mode="regenerate"
        )
        assert regenerate == {pk: "made in mode on_policy, configured regenerate"}
    rows = pl.read_parquet(root.joinpath(*table_file(pk))).sort("index").to_dicts()
    assert len(finished) < len(rows), "the kill came after the last turn: nothing was left to resume"
    assert metadata["turns_resumed"].value == len(finished)
    assert metadata["turns_generated"].value == len(rows) - len(finished)
    by_key = {r["index"]: r for r in rows}
    assert len({(r["conversation_id"], r["turn"]) for r in rows}) == len(rows)  # none duplicated
    for old in finished:  # every finished turn kept as it was
        kept = by_key[old["index"]]
        assert list(kept["output_token_ids"]) == old["output_token_ids"] and kept["messages"] == old["messages"]
    resent = [r["messages"] for r in requests(log)[sent_before:]]
    assert not [old for old in finished if json.loads(old["messages"]) in resent]  # no finished turn sent again
    assert len(resent) == len(rows) - len(finished)
    for cid in {r["conversation_id"] for r in rows}:
        conversation = [r for r in rows if r["conversation_id"] == cid]
        expected_conversation(conversation, max_rounds=3)
        if not any(blocks(json.loads(r["reply"])["content"]) for r in conversation):
            # no call: each user turn gets one answer, and the trajectory moves on at it
            assert len(conversation) == len(tasks()[cid.split(":", 1)[1]].turns)
    assert check_rows_train_on_what_was_sampled(rows) == len(rows)


def check_turns_tokenized_and_trained(root: Path, pk: str, tokenized_meta, hidden_meta, drafter_meta) -> None:
    """Every on-policy turn is a tokenized row: input_ids = the server's prompt_token_ids + the turn's output ids
    (+ the end token of a stopped turn), the loss on exactly those sampled tokens; the stored features hold the
    same rows under the same keys, and the drafter trained on them."""
    end = load_target_builder(InferenceServerResource(mode="vllm"), resources_template()).end_token_id
    turns = {r["index"]: r for r in pl.read_parquet(root.joinpath(*table_file(pk))).to_dicts()}
    tokenized = pl.read_parquet(root.joinpath(*tokenized_file(pk))).sort("index").to_dicts()
    assert tokenized_meta["completions_mode"].value == "on_policy"
    assert [r["index"] for r in tokenized] == sorted(turns)  # every turn (truncated: keep)
    corpus = pl.read_parquet(root / "prompt_corpus" / "corpus.parquet")
    hashes = dict(zip(corpus["index"].to_list(), corpus["content_hash"].to_list()))
    server_prompts = 0
    for row in tokenized:
        turn = turns[row["index"]]
        output = list(turn["output_token_ids"])
        sampled = output + ([end] if turn["finish_reason"] == "stop" and output[-1] != end else [])
        mask = list(row["loss_mask"])
        assert list(row["input_ids"])[row["prompt_len"] :] == sampled
        assert sum(mask) == row["num_loss_tokens"] == len(sampled)
        assert mask == [0] * row["prompt_len"] + [1] * len(sampled)  # no context token carries loss
        if turn["prompt_token_ids"] is not None:  # every real turn: the context is what the server saw
            assert list(row["input_ids"]) == list(turn["prompt_token_ids"]) + sampled
            server_prompts += 1
        # checked against the corpus row its conversation started from
        assert row["corpus_index"] == row["index"] // TURN_STRIDE
        assert row["prompt_hash"] == hashes[row["corpus_index"]]
    assert server_prompts == len(tokenized) - 2  # all but the two scripted first turns
    # the features: the same rows, keys and ids
    index = json.loads((root / "hidden_states" / pk / "index.json").read_text())
    assert hidden_meta["rows"].value == index["num_rows"] == len(tokenized)
    stored = {}
    for shard in index["shards"]:
        data = read_shard(str(root / "hidden_states" / pk / shard["name"]))
        cu = data.cu_seqlens.tolist()
        for r, key in enumerate(data.row_index.tolist()):
            stored[key] = (data.input_ids[cu[r] : cu[r + 1]].tolist(), data.loss_mask[cu[r] : cu[r + 1]].tolist())
    assert stored == {r["index"]: (list(r["input_ids"]), list(r["loss_mask"])) for r in tokenized}
    assert drafter_meta["features"].value == "offline" and drafter_meta["steps"].value == 2
