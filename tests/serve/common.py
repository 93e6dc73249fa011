"""What the server's tests share: a tiny synthetic model and services over it."""

from __future__ import annotations

from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY
from fuselane.serve.server import Options, build

CTX = 128


def tiny_model(directory, ctx: int = CTX):
    return load(write_synthetic(directory / "tiny.gguf", "tiny-qwen2", "q8_0", seed=11), lane="cpu", ctx=ctx)


def service(model, lines: list[str] | None = None, **options):
    """A service over `model` whose log lines go to `lines`."""
    sink = lines.append if lines is not None else (lambda line: None)
    return build(Options(**options), model=model, say=sink)


def chat_reply(model, text: str, max_tokens: int) -> str:
    """What the model replies alone to one user message, greedily: what the server must return."""
    return model.generate(text, max_tokens=max_tokens, sampling=GREEDY)


def text_reply(model, prompt: str, max_tokens: int) -> str:
    return model.generate(prompt, max_tokens=max_tokens, sampling=GREEDY, raw=True)
