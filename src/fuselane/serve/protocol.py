"""OpenAI's request bodies for `/v1/chat/completions` and `/v1/completions`, read and checked.

Every field fuselane honours is checked for its type and range, and a bad one is a `BadRequest` naming it (an
HTTP 400 in OpenAI's error JSON). Fields that change what is generated but that fuselane does not implement
(penalties, logit biases, log-probabilities, tools, more than one choice) are refused when set to anything but
their neutral value, rather than quietly ignored; fields that change nothing here (`user`, `metadata`, ...) are
ignored. Defaults are OpenAI's: temperature 1, top_p 1, no top-k (an extension, as llama.cpp's and vLLM's
servers take it), up to the context's end for a chat and 16 tokens for a completion.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass
from typing import Any

from fuselane.errors import FuselaneError
from fuselane.ranges import MAX_CTX, SEED, TEMPERATURE, TOP_K, TOP_P, Bound
from fuselane.runtime.sampling import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 16  # stop strings a request may give (OpenAI takes 4; more only costs a scan per token)
MAX_STOP_CHARS = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that would change the reply, with the value that means "off"; anything else is refused.
NEUTRAL = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class BadRequest(FuselaneError):
    """A request the server refuses with HTTP 400; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Kind(enum.Enum):
    CHAT = "chat"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class Ask:
    """A completion request, read: what to prompt with, and how to generate and reply."""

    kind: Kind
    messages: tuple[dict[str, str], ...] | None  # a chat's conversation
    text: str | None  # a completion's prompt as text ...
    ids: tuple[int, ...] | None  # ... or as token ids
    max_tokens: int | None  # None: to the context's end
    sampling: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool  # vLLM's extension: the model's end tokens do not end the reply
    stream: bool
    include_usage: bool


def parse_chat(body: Any) -> Ask:
    body = _object(body)
    messages = tuple(_message(m, i) for i, m in enumerate(_list(body.get("messages"), "messages")))
    if not messages:
        raise BadRequest("messages must hold at least one message", "messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return _ask(body, Kind.CHAT, messages=messages, max_tokens=_tokens(limit, None))


def parse_completion(body: Any) -> Ask:
    body = _object(body)
    text, ids = _prompt(body.get("prompt"))
    max_tokens = _tokens(body.get("max_tokens"), COMPLETION_MAX_TOKENS)
    return _ask(body, Kind.TEXT, text=text, ids=ids, max_tokens=max_tokens)


def _ask(body: dict[str, Any], kind: Kind, **prompt: Any) -> Ask:
    _neutral(body)
    n = body.get("n")
    if n is not None and (_not_int(n) or n != 1):
        raise BadRequest("n must be 1: the server returns one choice a request", "n")
    stream = _flag(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    usage = _flag((options or {}).get("include_usage"), "stream_options.include_usage")
    prompt.setdefault("messages", None)
    prompt.setdefault("text", None)
    prompt.setdefault("ids", None)
    return Ask(kind=kind, sampling=_sampling(body), stop=_stops(body.get("stop")),
               ignore_eos=_flag(body.get("ignore_eos"), "ignore_eos"), stream=stream, include_usage=usage,
               **prompt)  # fmt: skip


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    return body


def _neutral(body: dict[str, Any]) -> None:
    for field, off in NEUTRAL.items():
        value = body.get(field)
        # `False == 0` in Python: a flag is off only as a flag, a number only as a number
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off):
            raise BadRequest(f"{field} is not supported by this server (leave it out)", field)


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{param} must be an array", param)
    return value


def _message(m: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object", where)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}", f"{where}.role")
    return {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)}


def _content(content: Any, where: str) -> str:
    """A message's text: a string, null (an assistant's turn that called tools), or text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = _list(content, f"{where}.content")
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise BadRequest(f"{where}.content[{j}] must be a text part: the model reads only text", f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A completion's prompt: a string, token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and not any(_not_int(t) for t in prompt):
        return None, tuple(prompt)
    raise BadRequest("prompt must be a string or an array of token ids (one prompt a request)", "prompt")


def _not_int(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _flag(value: Any, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{param} must be true or false", param)
    return value


def _tokens(value: Any, default: int | None) -> int | None:
    if value is None:
        return default
    if _not_int(value) or not 0 <= value <= MAX_CTX:
        raise BadRequest(f"max_tokens must be an integer in [0, {MAX_CTX}]", "max_tokens")
    return value


def _number(body: dict[str, Any], param: str, bound: Bound, default: float) -> Any:
    value = body.get(param)
    if value is None:
        return default
    number = numbers.Integral if bound.kind.name == "INT" else numbers.Real
    if isinstance(value, bool) or not isinstance(value, number) or not bound.contains(value):
        raise BadRequest(f"{param} must be {bound.describe()}", param)
    return value


def _sampling(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=float(_number(body, "temperature", TEMPERATURE, 1.0)),
        top_k=int(_number(body, "top_k", TOP_K, 0)),
        top_p=float(_number(body, "top_p", TOP_P, 1.0)),
        seed=None if body.get("seed") is None else int(_number(body, "seed", SEED, 0)),
    )


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)
