"""Real chat templates of the model families fuselane meets render exactly as transformers renders them.

The templates in `templates/` are the families' own (Qwen2.5 from the Qwen2.5-Coder GGUF; Qwen3, Qwen3-Coder,
DeepSeek-R1 (Qwen distill), Llama 3.3 and Mistral Nemo as llama.cpp keeps them in models/templates). Each is
rendered by the metered sandbox and by `transformers.utils.chat_template_utils.render_jinja_template` on
conversations that reach their branches: system prompts, multi-turn, reasoning, tool calls and results, tools.
They also stay far inside the render budget on a long conversation: metering must not refuse real work.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fuselane.errors import FuselaneError
from fuselane.text.chat import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {
    "qwen2.5": ("<|endoftext|>", "<|im_end|>"),
    "qwen3": ("<|endoftext|>", "<|im_end|>"),
    "qwen3-coder": ("<|endoftext|>", "<|im_end|>"),
    "deepseek-r1-distill-qwen": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "llama-3.3": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral-nemo": ("<s>", "</s>"),
}
LONG_TURNS = 400  # a long conversation: 800 messages
LONG_SECONDS = 1.0  # rendering it: far below the budget's 1.5 s, on a shared machine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo du jour, 天気",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city"},
                    "unit": {"type": "string", "enum": ["c", "f"], "x-extra": {"a": 1}},
                },
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Kyōto"}}}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one turn": [{"role": "user", "content": "Write hello world in C."}],
    "system": [
        {"role": "system", "content": "You are terse. 日本語で答えて。"},
        {"role": "user", "content": "  Hi!\n\n"},
    ],
    "multi turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 😀 × 3?"},
    ],
    "tool call": [
        {"role": "user", "content": "Weather in Kyōto?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"sky": "晴れ"}', "tool_call_id": "call12345"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool call, JSON arguments": [
        {"role": "user", "content": "Weather in Kyōto?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": '{"city": "Kyōto"}'}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call12345"},
    ],
}


def source(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def hf_render(family: str, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str | None:
    """transformers' rendering, or None where the template fails on the conversation."""
    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos = FAMILIES[family]
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=source(family),
            add_generation_prompt=generation,
            bos_token=bos,
            eos_token=eos,
        )
    except Exception:  # a template's raise_exception, or its own TypeError on data it does not expect
        return None
    return rendered[0]


def our_render(family: str, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str | None:
    bos, eos = FAMILIES[family]
    template = ChatTemplate(source(family), bos_token=bos, eos_token=eos)
    try:
        return template.render(messages, tools=tools, add_generation_prompt=generation)
    except FuselaneError as e:
        # the template's own failure, never the sandbox's or the budget's
        assert "stopped" not in str(e) and "sandbox" not in str(e), str(e)
        return None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_family_renders_as_transformers(family, name, with_tools):
    pytest.importorskip("transformers")
    messages, tools = CONVERSATIONS[name], TOOLS if with_tools else None
    for generation in (True, False):
        expected = hf_render(family, messages, tools, generation)
        assert our_render(family, messages, tools, generation) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_family_renders_every_conversation(family):
    # the comparison above is only worth something where the template renders; most conversations must
    rendered = [our_render(family, m, None, True) for m in CONVERSATIONS.values()]
    assert sum(r is not None for r in rendered) >= len(rendered) - 1, rendered


@pytest.mark.parametrize("family", FAMILIES)
def test_family_renders_a_long_conversation_well_inside_the_budget(family):
    bos, eos = FAMILIES[family]
    template = ChatTemplate(source(family), bos_token=bos, eos_token=eos)
    turns = [
        [{"role": "user", "content": f"question {i}: " + "words " * 50}, {"role": "assistant", "content": f"{i}"}]
        for i in range(LONG_TURNS)
    ]
    messages = [message for turn in turns for message in turn] + [{"role": "user", "content": "last"}]
    started = time.perf_counter()
    rendered = template.render(messages, tools=TOOLS)
    seconds = time.perf_counter() - started
    assert "question 399" in rendered and seconds < LONG_SECONDS, f"{seconds:.2f} s"
