"""The JSON that OpenAI's clients read back: completions, stream chunks, usage, the model list and errors.

Shapes follow OpenAI's API reference: `chat.completion` / `chat.completion.chunk` for chats, `text_completion`
for completions (its stream chunks carry the same object name), an error as
`{"error": {"message", "type", "param", "code"}}`. A stream is server-sent events, `data: <json>` each,
ended by `data: [DONE]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fuselane.serve.protocol import Kind

DONE = "data: [DONE]\n\n"
OBJECTS = {Kind.CHAT: ("chat.completion", "chat.completion.chunk"), Kind.TEXT: ("text_completion", "text_completion")}
ID_PREFIX = {Kind.CHAT: "chatcmpl-", Kind.TEXT: "cmpl-"}


def error(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def event(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def model_card(name: str, created: int, ctx: int) -> dict[str, Any]:
    """A model as `/v1/models` lists it; `max_model_len` (the context a sequence gets) as vLLM adds it."""
    return {"id": name, "object": "model", "created": created, "owned_by": "fuselane", "max_model_len": ctx}


@dataclass(frozen=True, slots=True)
class Reply:
    """What every body of one request's reply repeats."""

    kind: Kind
    id: str
    created: int
    model: str

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, prompt: int, completion: int) -> dict[str, Any]:
        """The non-streamed reply."""
        if self.kind is Kind.CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        choice["logprobs"] = None
        return self._head(OBJECTS[self.kind][0]) | {"choices": [choice], "usage": usage(prompt, completion)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False) -> dict[str, Any]:
        """A stream chunk: new text (`role` on a chat's first, which names the assistant), or the finish."""
        if self.kind is Kind.CHAT:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": finish}
        return self._head(OBJECTS[self.kind][1]) | {"choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int) -> dict[str, Any]:
        """The stream's last chunk under `stream_options.include_usage`: no choices, the counts."""
        return self._head(OBJECTS[self.kind][1]) | {"choices": [], "usage": usage(prompt, completion)}
