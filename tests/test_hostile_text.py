"""Hostile text, end to end: chat-template bombs, text that is not UTF-8, and prompts far past the context.

Every case runs the `fuselane` command in a subprocess under `tests.bounded` (1.5 GiB of address space and a
timeout) and must end in one `fuselane: error:` line and exit code 1 within seconds: a template that loops or
builds without end is stopped by its render budget, invalid UTF-8 in argv or on stdin is named, and a prompt
longer than the context is refused before it is tokenized whole (a 20 MB prompt on stdin, a template writing
60 million characters). `chat` greets on stderr first, so there the error must be the one error line.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.bounded import FAST, assert_one_line_error, run_bounded
from tests.test_bad_input import tiny_meta, tiny_weights, write_gguf
from tests.text.test_chat_budget import BOMBS

CTX = "64"
HUGE_PROMPT = b"the quick brown fox jumps over the lazy dog " * (20 << 20 >> 6)  # ~14 MB of text, 3M tokens
HUGE_OUTPUT = "{% for i in range(60) %}{{ 'x' * 1000000 }}{% endfor %}"  # 60 million characters
# One bomb of each kind of work for the command (tests/text/test_chat_budget.py runs them all in process).
CLI_BOMBS = [
    "nested empty loops",
    "lipsum",
    "string doubled with ~",
    "string doubled with +",
    "list doubled",
    "shared list nesting printed",
    "repeated integer products",
    "integer power",
    "format width",
    "percent width",
    "center filter",
    "indent filter",
    "replace method",
    "join filter",
    "batch fill",
    "sum of lists",
    "set accumulating in a loop",
    "macro recursion",
    "caller recursion",
    "recursive loop",
    "comparisons in a loop",
    "method calls in nested loops",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The tiny model with its ChatML template ('good'), and one with each hostile template, by name."""
    folder = tmp_path_factory.mktemp("hostile-text")
    weights, meta = tiny_weights(), tiny_meta()
    paths = {"good": write_gguf(folder / "good.gguf", "qwen2", meta, weights)}
    templates = {name: BOMBS[name] for name in CLI_BOMBS} | {"huge output": HUGE_OUTPUT}
    for n, (name, source) in enumerate(templates.items()):
        paths[name] = write_gguf(folder / f"t{n}.gguf", "qwen2", meta | {"tokenizer.chat_template": source}, weights)
    return {name: str(path) for name, path in paths.items()}


def assert_chat_error(done: subprocess.CompletedProcess, seconds: float) -> str:
    """`chat` greets and prompts on stderr: its error is the one `fuselane: error:` there, and exit 1."""
    err = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    errors = [line[line.index("fuselane: error: ") :] for line in err.splitlines() if "fuselane: error: " in line]
    assert len(errors) == 1 and done.returncode == 1, (done.returncode, err)
    assert seconds < FAST, f"took {seconds:.1f} s"
    return errors[0]


def test_the_memory_limit_leaves_room_for_a_real_chat(models):
    done, _ = run_bounded(("run", "--ctx", CTX, "-n", "2", "--temp", "0", models["good"], "hello"))
    assert done.returncode == 0, done.stderr.decode()


@pytest.mark.parametrize("name", CLI_BOMBS)
def test_template_bomb_is_one_line(models, name):
    done, seconds = run_bounded(("run", "--ctx", CTX, "-n", "1", models[name], "hi"))
    message = assert_one_line_error(done, seconds)
    assert "chat template" in message or "context" in message, message


def test_template_writing_60_million_characters_is_refused_by_the_context(models):
    done, seconds = run_bounded(("run", "--ctx", "4096", "-n", "1", models["huge output"], "hi"))
    assert "past the context of 4096" in assert_one_line_error(done, seconds)


@pytest.mark.parametrize(
    "argv",
    [
        ("run", "--raw", "{good}", b"caf\xe9 \xff"),
        ("run", "{good}", b"caf\xe9 \xff"),
        ("tokenize", "{good}", b"\xffhello"),
        ("tokenize", "--special", "{good}", b"hello\xc3"),
    ],
    ids=["run raw", "run chat", "tokenize", "tokenize special"],
)
def test_invalid_utf8_in_argv_is_one_line(models, argv):
    done, seconds = run_bounded(tuple(a.format(**models) if isinstance(a, str) else a for a in argv))
    assert "not valid UTF-8: the byte 0x" in assert_one_line_error(done, seconds)


def test_invalid_utf8_system_message_is_one_line(models):
    done, seconds = run_bounded(("chat", "--system", b"\xfe", models["good"]), stdin=b"hi\n")
    assert "the system message is not valid UTF-8: the byte 0xFE" in assert_one_line_error(done, seconds)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "chat template"])
def test_invalid_utf8_on_stdin_is_one_line(models, raw):
    argv = ("run", *(["--raw"] if raw else []), models["good"], "-")
    done, seconds = run_bounded(argv, stdin=b"hello \xf0\x9f wor\xffld")
    assert "the prompt on stdin is not valid UTF-8: the byte 0xF0 at byte 6" in assert_one_line_error(done, seconds)


def test_invalid_utf8_chat_line_is_one_error(models):
    done, seconds = run_bounded(("chat", "--ctx", CTX, "-n", "1", models["good"]), stdin=b"hi \xff\n")
    assert "a chat line on stdin is not valid UTF-8: the byte 0xFF at byte 3" in assert_chat_error(done, seconds)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "chat template"])
def test_huge_prompt_on_stdin_is_refused_before_tokenizing(models, raw):
    argv = ("run", *(["--raw"] if raw else []), "--ctx", CTX, models["good"], "-")
    done, seconds = run_bounded(argv, stdin=HUGE_PROMPT)
    message = assert_one_line_error(done, seconds)
    assert "the prompt on stdin is more than" in message and f"past the context of {CTX}" in message, message


def test_huge_prompt_fitting_the_byte_bound_is_refused_by_tokens(models):
    # under the byte bound (so read whole), yet thousands of tokens: tokenizing stops past the context
    done, seconds = run_bounded(("run", "--raw", "--ctx", "4096", models["good"], "-"), stdin=HUGE_PROMPT[:40000])
    assert "past the context of 4096" in assert_one_line_error(done, seconds)


def test_huge_chat_line_is_one_error(models):
    done, seconds = run_bounded(("chat", "--ctx", CTX, "-n", "1", models["good"]), stdin=HUGE_PROMPT + b"\n")
    assert "a chat line on stdin is more than" in assert_chat_error(done, seconds)


def test_a_prompt_that_fits_still_runs(models, tmp_path: Path):
    done, _ = run_bounded(("run", "--raw", "--ctx", CTX, "-n", "2", models["good"], "-"), stdin="héllo 日本".encode())
    assert done.returncode == 0, done.stderr.decode()


def test_a_chat_turn_past_the_context_leaves_the_conversation_as_it_was(models):
    from fuselane.runtime.model import load
    from fuselane.text.utf8 import PromptTooLong

    m = load(models["good"], lane="cpu", ctx=int(CTX))
    try:
        chat = m.chat(system="be brief")
        with pytest.raises(PromptTooLong, match=f"past the context of {CTX}"):
            list(chat.say("word " * 1000, max_tokens=1))
        assert [message["role"] for message in chat.messages] == ["system"]
        list(chat.say("hi", max_tokens=1))
        assert [message["role"] for message in chat.messages] == ["system", "user", "assistant"]
    finally:
        m.close()
