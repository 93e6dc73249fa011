"""The server's routes through a real HTTP client (httpx) against the ASGI application: every endpoint, streamed
and not, replies equal to the model's own, concurrent requests, and the 400/401/404/429 cases in OpenAI's error
JSON, one log line each."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serve.common import chat_reply, service, text_reply, tiny_model

HI = {"role": "user", "content": "hi there"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("app"))


@pytest.fixture(scope="module")
def served(model):
    lines: list[str] = []
    svc = service(model, lines, max_seqs=3, max_queue=8)
    svc.engine.start()  # an in-process client runs no lifespan
    yield svc, lines
    svc.engine.stop()


def call(svc, *requests):
    """Send (method, path, json) requests together; their responses, in order."""
    from fuselane.serve.app import create_app

    async def go():
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://fuselane") as client:
            return await asyncio.gather(*(client.request(m, p, json=body, headers=h) for m, p, body, h in requests))

    return asyncio.run(go())


def one(svc, method, path, body=None, headers=None):
    return call(svc, (method, path, body, headers))[0]


def events(response) -> list:
    """The data of a server-sent event stream; the last must be [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_health_and_models(served):
    svc, _ = served
    health = one(svc, "GET", "/health").json()
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0 and health["kv_blocks_total"] > 0
    models = one(svc, "GET", "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [svc.name]
    assert models["data"][0]["max_model_len"] == svc.model.ctx
    assert one(svc, "GET", f"/v1/models/{svc.name}").json()["id"] == svc.name
    missing = one(svc, "GET", "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_whole_and_streamed(served, model):
    svc, lines = served
    expect = chat_reply(model, HI["content"], 9)
    whole = one(
        svc, "POST", "/v1/chat/completions", {"model": "x", "messages": [HI], "max_tokens": 9, "temperature": 0}
    )
    body = whole.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == expect
    prompt = len(model.prompt_ids(HI["content"]))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 9, "total_tokens": prompt + 9}
    assert body["choices"][0]["finish_reason"] == "length"
    assert lines[-1].startswith(body["id"]) and f"in={prompt} out=9" in lines[-1]
    ask = {
        "messages": [HI],
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = events(one(svc, "POST", "/v1/chat/completions", ask))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expect
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_completions_whole_streamed_and_from_ids(served, model):
    svc, _ = served
    expect = text_reply(model, "def f(x):", 7)
    body = one(svc, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 7, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expect
    chunks = events(
        one(svc, "POST", "/v1/completions", {"prompt": ["def f(x):"], "max_tokens": 7, "top_k": 1, "stream": True})
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == expect
    ids = model.prompt_ids("def f(x):", raw=True)
    by_ids = one(svc, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 7, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == expect
    ignoring = {"prompt": "def f(x):", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    assert one(svc, "POST", "/v1/completions", ignoring).json()["usage"]["completion_tokens"] == 7
    default = one(svc, "POST", "/v1/completions", {"prompt": "def f(x):", "temperature": 0}).json()
    assert default["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens for completions


def test_stop_strings_and_seeds(served, model):
    svc, _ = served
    whole = text_reply(model, "a b c", 12)
    stop = whole[4:6]
    body = one(svc, "POST", "/v1/completions", {"prompt": "a b c", "max_tokens": 12, "temperature": 0, "stop": [stop]})
    assert body.json()["choices"][0] == {
        "index": 0, "text": whole[: whole.index(stop)], "finish_reason": "stop", "logprobs": None
    }  # fmt: skip
    seeded = {"prompt": "a b c", "max_tokens": 12, "temperature": 1.0, "seed": 42}
    a, b = call(svc, *[("POST", "/v1/completions", seeded, None)] * 2)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


def test_concurrent_requests_each_get_their_own_reply(served, model):
    svc, _ = served
    texts = [f"question number {i}" for i in range(7)]  # more than max_seqs: some wait, then join
    asks = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": t}], "max_tokens": 5 + i,
             "temperature": 0, "stream": i % 2 == 1}, None) for i, t in enumerate(texts)]  # fmt: skip
    for i, (text, response) in enumerate(zip(texts, call(svc, *asks), strict=True)):
        if i % 2:
            got = "".join(c["choices"][0]["delta"].get("content", "") for c in events(response))
        else:
            got = response.json()["choices"][0]["message"]["content"]
        assert got == chat_reply(model, text, 5 + i)
    assert one(svc, "GET", "/health").json()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [HI], "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [HI], "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": [HI], "top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"messages": [HI], "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": [HI], "logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"messages": [HI], "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
        ("/v1/completions", {"prompt": "word " * 200}, None),  # past the context of 128
        ("/v1/completions", {"prompt": [1, 2, 99999]}, None),  # past the vocabulary
        ("/v1/completions", [1, 2], None),
    ],
)
def test_bad_requests_are_400_with_openai_errors(served, path, body, param):
    svc, _ = served
    response = one(svc, "POST", path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_bad_json_unknown_routes_and_methods(served):
    svc, _ = served
    (bad,) = call(svc, ("POST", "/v1/completions", None, {"content-type": "application/json"}))
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert one(svc, "GET", "/v1/nothing").status_code == 404
    wrong = one(svc, "GET", "/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_the_api_key(model):
    svc = service(model, max_seqs=1, api_key="s3cret")
    svc.engine.start()
    try:
        ask = {"prompt": "x", "max_tokens": 2}
        for headers in [None, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}]:
            for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", ask)]:
                response = one(svc, method, path, body, headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        good = {"authorization": "Bearer s3cret"}
        assert one(svc, "POST", "/v1/completions", ask, good).status_code == 200
        assert one(svc, "GET", "/health").status_code == 200  # health checks need no key
    finally:
        svc.engine.stop()


def test_a_full_queue_is_429(model):
    lines: list[str] = []
    svc = service(model, lines, max_seqs=1, max_queue=1)
    ask = ("POST", "/v1/completions", {"prompt": "x y", "max_tokens": 3}, None)
    from fuselane.serve.app import create_app

    async def go():
        transport = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=transport, base_url="http://fuselane") as client:
            waiting = [asyncio.create_task(client.request(*ask[:2], json=ask[2])) for _ in range(2)]
            while svc.engine.pending < 2:  # the engine is not running yet: both stay queued
                await asyncio.sleep(0.01)
            refused = await asyncio.wait_for(client.request(*ask[:2], json=ask[2]), 10)  # not queued: at once
            svc.engine.start()
            return refused, await asyncio.gather(*waiting)

    try:
        refused, served = asyncio.run(go())
    finally:
        svc.engine.stop()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert [r.status_code for r in served] == [200, 200]
    assert sum(" 429 " in line for line in lines) == 1 and len(lines) == 3
