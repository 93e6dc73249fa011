"""`fuselane serve` as a user starts it: bad option values are one line and exit code 1 (before any port is
taken or model loaded where the value alone is wrong), and a server started on a free port answers, logs one
line a request and stops on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from fuselane.gguf.synth import write_synthetic
from tests.bounded import assert_one_line_error, run_bounded

STARTUP = 30.0  # seconds a server may take to say where it listens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_synthetic(tmp_path_factory.mktemp("cli") / "tiny.gguf", "tiny-qwen3", "q8_0", seed=4))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--port", "70000"], "--port"),
        (["--kv-blocks", "3", "--ctx", "256"], "less than one context"),
    ],
)
def test_bad_values_are_one_line(tiny, argv, words):
    done, seconds = run_bounded(["serve", tiny, "--port", "0", *argv])
    assert words in assert_one_line_error(done, seconds)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"gpu_memory": 0.5, "lane": "cpu"}, "--kv-blocks"),
    ],
)
def test_a_setup_that_cannot_serve_is_refused_in_one_line(tiny, options, words):
    from fuselane.errors import FuselaneError
    from fuselane.serve.server import Options, build

    with pytest.raises(FuselaneError, match=words) as refused:
        build(Options(model=tiny, **options))
    assert "\n" not in str(refused.value)


def test_a_lane_without_a_batch_form_is_refused_in_one_line():
    from fuselane.engine.lanes import paged_type
    from fuselane.errors import FuselaneError

    with pytest.raises(FuselaneError, match="does not run batches of sequences yet; use --lane cpu or cuda"):
        paged_type("metal")


def test_a_busy_port_is_one_line(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done, seconds = run_bounded(["serve", tiny, "--port", str(taken.getsockname()[1])])
    assert "cannot listen on 127.0.0.1:" in assert_one_line_error(done, seconds)


def test_serve_answers_logs_and_stops(tiny):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuselane", "serve", tiny, "--port", "0", "--ctx", "64", "--max-seqs", "2"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        first = proc.stderr.readline()
        assert first.startswith("serving tiny on http://127.0.0.1:"), first
        url = first.split(" on ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        ask = json.dumps({"prompt": "hi", "max_tokens": 3}).encode()
        request = urllib.request.Request(f"{url}/completions", ask, {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=STARTUP) as response:
            assert json.load(response)["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=STARTUP)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and out == ""
    (line,) = err.splitlines()  # one line for the one request, and nothing else
    assert line.startswith("cmpl-") and " POST /v1/completions 200 in=" in line
