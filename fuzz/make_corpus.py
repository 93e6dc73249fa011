"""Write the seed corpora under fuzz/corpus/: tiny valid GGUF files and real-looking chat templates.

Seeds give the fuzzer a start inside the format, so that its mutations reach the tensor table, the tokenizer
keys and the model checks instead of dying at the magic. They are kept tiny (a few KB each) because every
execution parses the whole input: `python -m fuzz.make_corpus` rewrites them byte for byte the same. The
GGUF seeds are named `.bin` because the repository ignores `*.gguf` (checkpoints are never committed).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from gguf.constants import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from fuselane.gguf.synth import Shape, write_synthetic

CORPUS = Path(__file__).parent / "corpus"
READER = CORPUS / "gguf_reader"
TEMPLATES = CORPUS / "chat_template"

# The smallest models the recognizer accepts: one layer, a 4-wide residual, the synthetic tokenizer's
# minimum vocabulary. Only the header matters to the reader; the weights are a few hundred floats.
MICRO = {
    "micro-qwen2-f32.bin": (Shape("qwen2", 4, 1, 1, 1, 4, 4, 260, context=64, tied=True), "f32"),
    "micro-qwen3-f16.bin": (Shape("qwen3", 4, 1, 2, 1, 2, 4, 260, context=64), "f16"),
}


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _str(s: str) -> bytes:
    b = s.encode()
    return _u64(len(b)) + b


def _header(kvs: list[bytes], infos: list[bytes], data: bytes = b"", version: int = 3) -> bytes:
    head = _u32(GGUF_MAGIC) + _u32(version) + _u64(len(infos)) + _u64(len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % 32) + data if data else head


def _hand_made() -> dict[str, bytes]:
    """Small headers that exercise branches the models do not: nesting, alignment, v2, every scalar type."""
    vt = GGUFValueType
    scalars = [
        _str(f"s.{t.name.lower()}") + _u32(t) + bytes(8 if t in (vt.UINT64, vt.INT64, vt.FLOAT64) else 4)
        for t in (vt.UINT32, vt.INT32, vt.FLOAT32, vt.UINT64, vt.INT64, vt.FLOAT64)
    ]
    nested = _str("nested") + _u32(vt.ARRAY) + _u32(vt.ARRAY) + _u64(1) + _u32(vt.UINT8) + _u64(2) + b"\x01\x02"
    strings = _str("tokenizer.ggml.tokens") + _u32(vt.ARRAY) + _u32(vt.STRING) + _u64(2) + _str("a") + _str("b")
    align = _str("general.alignment") + _u32(vt.UINT32) + _u32(64)
    tensor = _str("w") + _u32(2) + _u64(8) + _u64(2) + _u32(GGMLQuantizationType.F32) + _u64(0)
    data = struct.pack("<16f", *range(16))
    return {
        "empty-v3.bin": _header([], []),
        "scalars-v2.bin": _header(scalars, [], version=2),
        "arrays.bin": _header([nested, strings], []),
        "one-tensor-aligned.bin": _header([align], [tensor], data + bytes(32)),
    }


TEMPLATE_SEEDS = {
    "chatml.jinja": (
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"
    ),
    "qwen-tools.jinja": (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
        "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}{%- for tool in tools %}"
        "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- else %}"
        "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + "
        "'<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
        "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
        "{{- '\\n<tool_call>\\n' + tool_call.function.name + '\\n</tool_call>' }}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "llama3.jinja": (
        "{{- bos_token }}{%- set ns = namespace(sys='') %}{%- for m in messages %}"
        "{%- if m['role'] == 'system' %}{%- set ns.sys = m['content'] | trim %}{%- else %}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
        "'<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    "gemma.jinja": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
    ),
    "loops-and-filters.jinja": (
        "{% for m in messages | selectattr('role', 'equalto', 'user') | list %}{{ loop.index }}:"
        "{{ m.content | upper | replace('A', 'b') }}{% if not loop.last %}, {% endif %}{% endfor %}"
        "{{ (messages | length) * 2 }}{{ strftime_now('%Y') | length }}{{ messages | map(attribute='role') "
        "| join('/') }}{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
    ),
}


def main() -> int:
    """Rewrite both corpora; prints what it wrote."""
    READER.mkdir(parents=True, exist_ok=True)
    TEMPLATES.mkdir(parents=True, exist_ok=True)
    for name, (shape, mix) in MICRO.items():
        write_synthetic(READER / name, shape, mix, seed=1)
    for name, data in _hand_made().items():
        (READER / name).write_bytes(data)
    for name, text in TEMPLATE_SEEDS.items():
        (TEMPLATES / name).write_text(text)
    for path in sorted(CORPUS.rglob("*.*")):
        print(f"{path.relative_to(CORPUS)}  {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
