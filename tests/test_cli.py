"""The `fuselane` command as a user runs it: a subprocess on tiny synthetic checkpoints (and, marked real, on
the real Qwen2.5-Coder-0.5B).

What the command prints is checked against the Python API on the same file and settings, so "stdout holds
the reply and nothing else" is an equality, not a guess about what a random model says. Every subprocess has
a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY, SamplingParams

TIMEOUT = 120  # seconds; the tiny cases take about half a second, the real model tens of seconds
ARCHS = ("qwen2", "qwen3")
# the CLI's sampling defaults, for the API side of a comparison
CLI_DEFAULTS = {"top_k": 40, "top_p": 0.95}
REAL_PROMPT = "Write a Python function that adds two numbers."


def fuselane(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> tuple[str, str, int]:
    """Run the command; stdout and stderr as text (UTF-8 asked for explicitly, whatever the test's locale)."""
    done = subprocess.run(
        [sys.executable, "-m", "fuselane", *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        timeout=TIMEOUT,
        env=os.environ | {"PYTHONIOENCODING": "utf-8"} | (env or {}),
    )
    # bytes decoded by hand: text mode would turn a '\r' the model emits into '\n'
    return done.stdout.decode("utf-8"), done.stderr.decode("utf-8", "replace"), done.returncode


def ok(*args: str, **kw: Any) -> str:
    """stdout of a run that must succeed without a traceback."""
    out, err, rc = fuselane(*args, **kw)
    assert rc == 0 and "Traceback" not in err, err
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    from fuselane.gguf.synth import write_synthetic

    d = tmp_path_factory.mktemp("cli")
    return {arch: str(write_synthetic(d / f"tiny-{arch}.gguf", f"tiny-{arch}", "q8_0", seed=11)) for arch in ARCHS}


@pytest.fixture(scope="session")
def api(tiny):
    models = {arch: load(path, lane="cpu") for arch, path in tiny.items()}
    yield models
    for m in models.values():
        m.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_run_raw_prints_the_completion_and_nothing_else(tiny, api, arch):
    text = "def add(a, b):"
    expected = api[arch].generate(text, raw=True, max_tokens=8, sampling=GREEDY)
    assert expected  # a reply that stopped at once would make the comparison empty
    assert ok("run", "--raw", "--temp", "0", "-n", "8", tiny[arch], text) == expected + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_run_uses_the_chat_template(tiny, api, arch):
    expected = api[arch].generate("hello there", max_tokens=8, sampling=GREEDY)
    assert expected != api[arch].generate("hello there", raw=True, max_tokens=8, sampling=GREEDY)
    assert ok("run", "--temp", "0", "-n", "8", tiny[arch], "hello there") == expected + "\n"


def test_run_reads_the_prompt_from_stdin(tiny, api):
    expected = api["qwen2"].generate("from a pipe", raw=True, max_tokens=6, sampling=GREEDY)
    assert ok("run", "--raw", "--temp", "0", "-n", "6", tiny["qwen2"], "-", stdin=b"from a pipe") == expected + "\n"


def test_the_same_seed_gives_the_same_text(tiny, api):
    seeds = (1, 2, 3, 4)
    replies = {}
    for seed in seeds:
        argv = ("run", "--raw", "--temp", "0.9", "--seed", str(seed), "-n", "8", tiny["qwen3"], "once upon")
        replies[seed] = ok(*argv)
        params = SamplingParams(temperature=0.9, seed=seed, **CLI_DEFAULTS)
        assert replies[seed] == api["qwen3"].generate("once upon", raw=True, max_tokens=8, sampling=params) + "\n"
        if seed == seeds[0]:
            assert ok(*argv) == replies[seed]  # and again in a fresh process
    assert len(set(replies.values())) > 1, "every seed gave the same text: the seed is not used"


@pytest.mark.parametrize(
    ("knob", "message"),
    [("prefill=in-place", "knobs are the cuda lane's; the cpu lane takes none"), ("bogus=1", "unknown knob 'bogus'")],
)
def test_a_knob_the_lane_cannot_take_is_one_line(tiny, knob, message):
    out, err, rc = fuselane("run", tiny["qwen2"], "hi", "--lane", "cpu", "--knob", knob)
    assert rc == 1 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_zero_tokens_generates_nothing(tiny):
    # as llama.cpp's -n 0: the prompt is read, nothing is generated, nothing is printed (not even a newline)
    for argv in (("--raw", "-n", "0", tiny["qwen2"], "hello"), ("-n", "0", tiny["qwen3"], "hello")):
        out, err, rc = fuselane("run", *argv)
        assert (out, err, rc) == ("", "", 0)


def _tokens(api, text: str, n: int) -> int:
    m = api["qwen2"]
    return sum(1 for _ in m.generate_ids(m.session(), m.prompt_ids(text, raw=True), max_tokens=n, sampling=GREEDY))


def test_a_reply_cut_by_n_says_so_on_stderr(tiny, api):
    assert _tokens(api, "hello", 5) == 5  # the reply is cut by -n, not ended by a stop token
    out, err, rc = fuselane("run", "--raw", "--temp", "0", "-n", "5", tiny["qwen2"], "hello")
    assert rc == 0 and err == "[stopped at -n 5 tokens]\n" and out.endswith("\n")


def test_a_chat_reply_cut_by_n_says_so_on_stderr(tiny, api):
    m = api["qwen2"]
    chat = m.chat()
    assert sum(1 for _ in chat.say("hello", max_tokens=4)) and chat.generated == 4  # cut by the limit, not ended
    out, err, rc = fuselane("chat", "--temp", "0", "-n", "4", tiny["qwen2"], stdin=b"hello\n")
    # after the "> " prompt chat writes on stderr
    assert rc == 0 and any(line.endswith("[stopped at -n 4 tokens]") for line in err.splitlines()), err


def test_a_reply_cut_by_the_context_says_so(tiny, api):
    prompt_tokens = len(api["qwen2"].prompt_ids("hello", raw=True))
    ctx = prompt_tokens + 3
    out, err, rc = fuselane("run", "--raw", "--temp", "0", "-n", "50", "--ctx", str(ctx), tiny["qwen2"], "hello")
    assert rc == 0 and err == f"[stopped at the end of the context of {ctx} tokens]\n"


def test_verbose_prints_the_prompt_and_generation_rates(tiny):
    _, err, rc = fuselane("run", "--raw", "--temp", "0", "-n", "6", "-v", tiny["qwen2"], "hello")
    lines = err.splitlines()
    assert rc == 0 and lines[0].startswith("loaded tiny-qwen2.gguf"), err
    assert any(line.startswith("prompt: ") and line.endswith("tokens/s)") for line in lines), err
    assert any(line.startswith("generation: 5 tokens in ") and line.endswith("tokens/s)") for line in lines), err


def test_version():
    from importlib.metadata import version

    out, err, rc = fuselane("--version")
    assert rc == 0 and out == f"fuselane {version('fuselane')}\n" and not err


def test_run_usage_reads_model_then_prompt():
    out = ok("run", "--help")
    assert out.startswith("usage: fuselane run [options] [MODEL] PROMPT\n")


@pytest.mark.parametrize("word", ["{path}", "qwen2.5-coder-0.5b", "missing.gguf"])
def test_a_lone_model_without_a_prompt_is_refused(tiny, word):
    word = word.format(path=tiny["qwen2"])
    out, err, rc = fuselane("run", word)
    assert rc == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("fuselane: error: ") and "no prompt follows it" in err and word in err


def test_a_closed_stdout_ends_quietly(tiny):
    # the reader has gone before the first piece is written: no BrokenPipeError, exit 0, as `yes | head`
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuselane", "run", "--raw", "-n", "40", tiny["qwen2"], "hello"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=TIMEOUT) == 0 and err == b"", err.decode()


@pytest.mark.parametrize(
    "text,special",
    [
        ("hello world", False),
        ("", False),
        ("  two  spaces\nand a newline\ttab", False),
        ("naïve café, 東京 🚀", False),
        ("<|im_start|>user<|im_end|>", False),  # written out: plain text unless --special
        ("<|im_start|>user<|im_end|>", True),
    ],
)
def test_tokenize_prints_the_api_encoding(tiny, api, text, special):
    out = ok("tokenize", tiny["qwen2"], text, *(["--special"] if special else []))
    assert json.loads(out) == api["qwen2"].tokenizer.encode(text, special=special)


def test_special_tokens_are_parsed_only_when_asked(tiny):
    plain = json.loads(ok("tokenize", tiny["qwen2"], "<|im_end|>"))
    special = json.loads(ok("tokenize", tiny["qwen2"], "<|im_end|>", "--special"))
    assert len(special) == 1 and len(plain) > 1


def test_bench_measures_the_cpu_lane(tiny):
    out, err, code = fuselane(
        "bench", tiny["qwen2"], "--lane", "cpu", "-p", "8", "-n", "4", "--depth", "0", "4", "--json"
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [r["depth"] for r in rows] == [0, 4]
    for r in rows:
        assert r["lane"] == "cpu:float32" and r["prompt"] == 8 and r["generated"] == 4
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and 0 < r["percent_of_limit"]
        assert r["peak_gpu_gb"] is None and r["peak_over_pct"] is None and r["prefill"] == ""  # no GPU memory
        assert r["dependent_launches"] is None  # the cuda lane's `pdl`
    table, err, code = fuselane("bench", tiny["qwen2"], "--lane", "cpu", "-p", "8", "-n", "4")
    assert code == 0 and "| cpu:float32 | pp8 |" in table and "| tg4 |" in table, err


@pytest.mark.parametrize("command", [(), ("run",), ("chat",), ("bench",), ("explain",), ("info",), ("tokenize",)])
def test_help_prints_for_every_command(command):
    # a help string with a bare % once made argparse raise instead of printing
    out, err, code = fuselane(*command, "--help")
    assert code == 0 and "usage: fuselane" in out and not err, err


@pytest.mark.parametrize("arch", ARCHS)
def test_info(tiny, arch):
    text = ok("info", tiny[arch])
    assert arch in text and "Q8_0" in text and "64" in text
    info = json.loads(ok("info", tiny[arch], "--json"))
    assert {"architecture", "shape", "quant_mix", "tokenizer"} <= info.keys()
    assert info["architecture"] == arch
    assert info["shape"]["n_embd"] == 64 and info["shape"]["layers"] == 2 and info["shape"]["vocab"] == 512
    assert info["shape"]["qkv_bias"] == (arch == "qwen2") and info["shape"]["qk_norm"] == (arch == "qwen3")
    assert set(info["quant_mix"]) == {"Q8_0", "F32"}
    assert info["tokenizer"]["tokens"] == 512 and info["tokenizer"]["chat_template"] is True


def test_models_lists_the_known_model():
    out = ok("models")
    assert out.splitlines()[0].startswith("qwen2.5-coder-0.5b")


def test_chat_replies_to_each_line_until_end_of_input(tiny, api):
    conversation = api["qwen3"].chat()
    expected = ["".join(conversation.say(line, max_tokens=6, sampling=GREEDY)) for line in ("hi", "and again")]
    assert all(expected)
    out = ok("chat", "--temp", "0", "-n", "6", tiny["qwen3"], stdin=b"hi\nand again\n")
    assert out == expected[0] + "\n" + expected[1] + "\n"


def test_chat_reset_and_exit(tiny, api):
    first = "".join(api["qwen3"].chat().say("hi", max_tokens=6, sampling=GREEDY))
    assert first
    # after /reset the same line gets the first reply again; /exit ends before the last line
    out = ok("chat", "--temp", "0", "-n", "6", tiny["qwen3"], stdin=b"hi\n/reset\nhi\n/exit\nnever read\n")
    assert out == first + "\n" + first + "\n"


def test_a_reply_the_terminal_cannot_encode_is_not_a_traceback(tiny, api):
    # random tokens decode to characters outside ASCII (at least U+FFFD); an ASCII stdout shows '?' instead
    expected = api["qwen2"].generate("hello", raw=True, max_tokens=12, sampling=GREEDY)
    assert not expected.isascii()
    out = ok("run", "--raw", "--temp", "0", "-n", "12", tiny["qwen2"], "hello", env={"PYTHONIOENCODING": "ascii"})
    assert out == expected.encode("ascii", "replace").decode() + "\n"


# --- the real model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_reply(qwen_gguf) -> str:
    # by name, as a user types it; qwen_gguf has made sure the cache holds it, so nothing is downloaded
    return ok("run", "--temp", "0", "-n", "24", "qwen2.5-coder-0.5b", REAL_PROMPT)


@pytest.mark.real
def test_real_model_writes_a_function(real_reply):
    # greedy, the reply opens "Here's a simple Python function to add two numbers:\n\n```python\ndef ..."
    # (twelve tokens stop at the fence, so this asks for 24)
    assert real_reply.strip() and "def" in real_reply


@pytest.mark.real
def test_run_without_a_model_uses_the_default_model(real_reply):
    # greedy decoding is a prefix of itself: 12 tokens of the default model open the named model's 24
    short = ok("run", "--temp", "0", "-n", "12", REAL_PROMPT).removesuffix("\n")
    assert short and real_reply.startswith(short)


def test_the_gpu_running_out_of_memory_is_one_line(monkeypatch, capsys):
    # torch.cuda.OutOfMemoryError (a RuntimeError) from anywhere in a command: one line, exit code 1
    from fuselane import cli

    class OutOfMemoryError(RuntimeError):
        pass

    said = (
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.8 GiB of which 1.2 GiB\n"
        "is free. Including non-PyTorch memory, this process has 138.5 GiB memory in use. If reserved but unallocated"
    )

    def hog(_args):
        raise OutOfMemoryError(said)

    monkeypatch.setattr(cli, "cmd_tokenize", hog)
    assert cli.main(["tokenize", "m.gguf", "hi"]) == 1
    err = capsys.readouterr().err
    assert err == "fuselane: error: out of GPU memory: CUDA out of memory. Tried to allocate 20.00 GiB.\n"

    def bug(_args):
        raise RuntimeError("a bug, not the GPU's memory")

    monkeypatch.setattr(cli, "cmd_tokenize", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["tokenize", "m.gguf", "hi"])


def test_bench_says_which_prefill_path_its_peak_took():
    # the cuda lane's peak depends on `prefill=auto`'s choice, which the table and the JSON name
    from fuselane.bench import BenchResult, as_json, render

    result = BenchResult("m.gguf", "cuda:H200:int8", 4.7, 512, 128, 0, 1.0, 1.0, 200, 4.7, 4800.0, 1000.0, 50.0, 17.98,
                         prefill="f16-copy")  # fmt: skip
    assert "| 17.98 GB (f16-copy) |" in render([result])
    assert as_json([result])[0]["prefill"] == "f16-copy"
    # and how far the peak is over the weights and cache, where the lane measured one
    over = BenchResult("m.gguf", "cuda:H200:int8", 0.49, 512, 128, 0, 1.0, 1.0, 172, 0.4, 4800.0, 1000.0, 50.0, 0.543,
                       prefill="f16-scratch", peak_over_pct=9.4)  # fmt: skip
    assert "| 0.543 GB (+9.4 %) (f16-scratch) |" in render([over])
    assert as_json([over])[0]["peak_over_pct"] == 9.4


def test_bench_names_the_chunk_rows_where_the_prompt_took_more_than_one():
    # a small model in a low-bit mix runs its prompt in 256-row chunks to hold the workspace share: the pp line
    # says so (llama-bench's ubatch), the tg line and a prompt of one chunk do not
    from fuselane.bench import BenchResult, as_json, render

    cut = BenchResult("m.gguf", "cuda:H200:int8", 0.41, 512, 128, 0, 1.0, 1.0, 172, 0.4, 4800.0, 1000.0, 50.0, 0.43,
                      prefill="f16-scratch", peak_over_pct=4.4, chunk_rows=256)  # fmt: skip
    lines = render([cut]).splitlines()
    assert "| pp512 (ub 256) |" in lines[2] and "| tg128 |" in lines[3]
    assert as_json([cut])[0]["chunk_rows"] == 256
    whole = BenchResult("m.gguf", "cuda:H200:int8", 0.41, 512, 128, 0, 1.0, 1.0, 172, 0.4, 4800.0, 1000.0, 50.0, 0.43,
                        chunk_rows=512)  # fmt: skip
    assert "| pp512 |" in render([whole])


def test_bench_marks_a_step_launched_in_plain_stream_order():
    # `pdl=auto` launches a grid-format model's steps plainly: its tg line says so, a dependent step's does not
    from fuselane.bench import BenchResult, as_json, render

    def result(dependent: bool) -> BenchResult:
        return BenchResult("m.gguf", "cuda:H100:int8", 3.6, 512, 128, 0, 1.0, 1.0, 199, 3.3, 3000.0, 900.0, 16.0,
                           3.8, dependent_launches=dependent)  # fmt: skip

    assert "| 199 (pdl off) |" in render([result(False)]).splitlines()[3]
    assert "| 199 |" in render([result(True)]).splitlines()[3]
    assert as_json([result(False)])[0]["dependent_launches"] is False
