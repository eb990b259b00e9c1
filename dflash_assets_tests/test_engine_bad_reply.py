"""Issue 32, finding 6: one malformed engine reply (a non-JSON 200, a field of the wrong type) aborted the whole
engine-mode evaluation; now it costs that prompt only. The engine is a stand-in speaking SGLang's /generate
over HTTP in its own process."""

from __future__ import annotations

import pytest

from dflash_assets.generation.servers.sglang_dflash import EnginePrompt, engine_generate, engine_tau_by_dataset
from dflash_assets_tests.script_server import script_server

SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        first = body["input_ids"][0]
        if first == 666:
            out = b"<html>gateway says hello</html>"
        elif first == 667:
            out = json.dumps({"meta_info": {"completion_tokens": "many", "spec_verify_ct": 3}}).encode()
        else:
            out = json.dumps({"text": "x", "meta_info": {"prompt_tokens": 3, "completion_tokens": 9,
                "finish_reason": {"type": "stop"}, "spec_accept_length": 3.0, "spec_verify_ct": 3}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out)

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def stand_in():
    with script_server(SERVER) as url:
        yield url


def test_a_malformed_reply_costs_its_prompt_only(stand_in):
    prompts = [EnginePrompt("heldout", i, (first, 1, 2)) for i, first in enumerate((5, 666, 667))]
    records = engine_generate([stand_in], prompts, 16, concurrency=1, max_attempts=1)
    assert [("error" in r) for r in records] == [False, True, True]
    assert "not JSON" in records[1]["error"] and "completion_tokens" in records[2]["error"]
    d = engine_tau_by_dataset(records)["heldout"]
    assert (d["requests"], d["requests_measured"], d["errors"]) == (3, 1, 2)
    assert d["tau"] == pytest.approx(3.0)
