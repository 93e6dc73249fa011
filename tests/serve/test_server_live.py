"""The server as it runs: uvicorn on a free port, a real TCP client and the official `openai` client. A client
that drops its stream (or stops waiting for a whole reply) cancels its sequence and its blocks come back."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from fuselane.serve.server import listen, server
from tests.serve.common import chat_reply, service, text_reply, tiny_model

KEY = "test-key"
LONG_CTX = 1024  # room for a reply long enough to be dropped while it runs
DEADLINE = 10.0  # seconds a test waits for the server to get somewhere


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("live"), ctx=LONG_CTX)


@pytest.fixture(scope="module")
def live(model):
    lines: list[str] = []
    svc = service(model, lines, max_seqs=4, api_key=KEY)
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    srv = server(svc)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: srv.started, "the server to start")
    yield svc, f"http://127.0.0.1:{port}", lines
    srv.should_exit = True
    thread.join(DEADLINE)
    assert not thread.is_alive()


def until(condition, what: str) -> None:
    ends = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < ends, f"waited {DEADLINE} s for {what}"
        time.sleep(0.01)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


def test_a_dropped_stream_cancels_its_sequence_and_frees_its_blocks(live):
    svc, url, lines = live
    before = health(url)["generated"]
    ask = {"prompt": "once upon a time", "max_tokens": LONG_CTX - 32, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=DEADLINE) as client, client.stream("POST", f"{url}/v1/completions", json=ask,
                                                                  headers=headers) as response:  # fmt: skip
        assert response.status_code == 200
        lines_in = response.iter_lines()
        got = [next(lines_in) for _ in range(4)]
        assert all(g.startswith("data: ") or g == "" for g in got)
        assert health(url)["kv_blocks_used"] > 0
    # the client is gone: the server notices, cancels, and the pool is whole again
    until(lambda: health(url)["kv_blocks_used"] == 0 and health(url)["running"] == 0, "the blocks to come back")
    until(lambda: any(line.endswith(" cancelled") for line in lines), "the log line")
    assert health(url)["generated"] - before < LONG_CTX - 32  # cut short: left alone it runs to max_tokens
    line = next(line for line in lines if line.endswith(" cancelled"))
    assert "POST /v1/completions 200" in line and int(line.split("out=")[1].split()[0]) < LONG_CTX - 32


def test_a_client_that_stops_waiting_cancels_its_sequence(live):
    svc, url, lines = live
    before = health(url)["generated"]
    ask = {"prompt": "tell a long story", "max_tokens": LONG_CTX - 32, "temperature": 0}  # runs for seconds
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=ask, headers={"authorization": f"Bearer {KEY}"}, timeout=0.2)
    until(lambda: health(url)["kv_blocks_used"] == 0 and health(url)["running"] == 0, "the blocks to come back")
    assert health(url)["generated"] - before < LONG_CTX - 32
    until(lambda: any(" POST /v1/completions 499 " in x and x.endswith(" cancelled") for x in lines), "the log line")


def test_the_openai_client(live, model):
    openai = pytest.importorskip("openai")
    svc, url, _ = live
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [svc.name]
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model=svc.name, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == chat_reply(model, "hello", 8)
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=svc.name, messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_reply(model, "hello", 8)
    text = client.completions.create(model=svc.name, prompt="1, 2, 3,", max_tokens=5, temperature=0)
    assert text.choices[0].text == text_reply(model, "1, 2, 3,", 5)
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=svc.name, messages=messages, n=2)


def test_the_load_script_runs_against_the_server(live, capsys):
    """benchmarks/load.py, briefly: every request completes or is dropped on purpose, none fails, and the
    blocks of the dropped ones come back."""
    from benchmarks.load import main

    svc, url, _ = live
    argv = ["--url", url, "--api-key", KEY, "--clients", "3", "--seconds", "1", "--max-tokens", "24", "--drop", "0.5",
            "--prompt-tokens", "4", "40", "--json"]  # fmt: skip
    assert main([*argv, "--lane", "cuda"]) == 1  # the server runs the cpu lane: not measured as another
    assert main([*argv, "--lane", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["levels"]
    assert result["lane"] == "cpu"
    assert row["errors"] == 0 and row["completed"] + row["dropped"] > 0 and row["kv_blocks_in_use_after"] == 0
    assert row["tokens"] > 0 and row["ttft_p50_ms"] is not None
    assert result["device_mb_idle"] == row["device_mb_after"] == 0  # the cpu lane holds no device memory
