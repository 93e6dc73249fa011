"""Chat templates: the GGUF's own Jinja2 template, rendered in a sandbox, and tokenized without injection.

A chat template is code that came with a downloaded file, so it runs in Jinja2's
`ImmutableSandboxedEnvironment` (no underscore attributes, no mutating methods), configured as Hugging Face's
`apply_chat_template` configures it (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text), so a template renders here exactly as it renders
there. Where Jinja2's sandbox would quietly render an unsafe attribute as an empty string, ours refuses, and
every failure is a one-line `FuselaneError`.

Tokenizing the rendered text is where a chat can be hijacked: a user message that spells `<|im_end|>` must not
end its turn. `encode_chat` therefore reads control tokens only in the text the template wrote, never in the
messages' content (see its docstring for how).
"""

from __future__ import annotations

import json
import numbers
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fuselane.errors import FuselaneError

if TYPE_CHECKING:
    from fuselane.text.tokenizer import Tokenizer

_TEMPLATE_KEY = "tokenizer.chat_template"
_TOKENS_KEY = "tokenizer.ggml.tokens"
_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

# ChatML, the format of Qwen and many others; used only when a ChatML vocabulary comes without a template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Limits on what a template can make the renderer build: a hostile template can otherwise ask for a string of
# 10**12 characters with one `*`. Real prompts are far below both.
MAX_RENDERED_CHARS = 64 * 1024 * 1024
MAX_POWER_BITS = 1 << 16

# Message fields holding text a person or the model wrote: these never become control tokens.
_CONTENT_FIELDS = ("content", "reasoning_content", "thinking")


class _TemplateRaised(TemplateError):
    """The template called `raise_exception`: it refuses this conversation."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML; chat templates want plain JSON, as HF renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)


class _SafeDict:
    """`dict(...)` for templates, without handing them the `dict` type itself (and its class machinery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """A Jinja `namespace` refusing underscore attributes: `{% set ns.__x = ... %}` cannot reach internals."""

    # No named `self`, as in Jinja's own Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text for training; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, made strict: unsafe access raises instead of rendering as nothing."""

    # Repetition and powers are checked so one expression cannot build a gigantic value.
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns an Undefined that prints as '' and raises only when used further; a template probing
        # for `__class__` should fail loudly instead of rendering a prompt with a hole in it.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int):
                    if len(sequence) * count > MAX_RENDERED_CHARS:
                        raise SecurityError("a repetition in the template is too large")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            # The result has about bit_length * exponent bits; chained powers get there fast.
            if right > 0 and max(abs(left).bit_length(), 1) * right > MAX_POWER_BITS:
                raise SecurityError("a power in the template is too large")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _SafeNamespace
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so the template sees no object whose methods the sandbox allows.

    Anything else (an image, an array) becomes a placeholder naming its type, as in HF.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """A conversation-to-prompt template: the GGUF's `tokenizer.chat_template`, compiled in the sandbox.

    `ChatTemplate.from_metadata` falls back to ChatML (`CHATML_TEMPLATE`, with no default system prompt) when
    the file has no template but its vocabulary has `<|im_start|>` and `<|im_end|>`, as Qwen-style files do;
    `is_fallback` then says so. Without either, it raises `FuselaneError`.
    """

    __slots__ = ("source", "bos_token", "eos_token", "is_fallback", "_template")

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", is_fallback: bool = False):
        """Compile `source`; a template that does not parse raises `FuselaneError`."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as exc:
            raise FuselaneError(
                f"chat template does not parse (line {exc.lineno}): {_one_line(exc.message or '')}"
            ) from None
        except Exception as exc:  # the parser itself can fail on hostile input, e.g. RecursionError
            raise FuselaneError(f"chat template does not compile: {type(exc).__name__}: {_one_line(exc)}") from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> ChatTemplate:
        """The chat template of a GGUF, from its metadata (ChatML fallback: see the class docstring)."""
        tokens: Sequence[str] = meta.get(_TOKENS_KEY) or ()
        bos_token = _token_text(meta, "bos_token_id", tokens)
        eos_token = _token_text(meta, "eos_token_id", tokens)
        source = meta.get(_TEMPLATE_KEY)
        if isinstance(source, str) and source.strip():
            return cls(source, bos_token=bos_token, eos_token=eos_token)
        if all(token in tokens for token in _CHATML_TOKENS):
            return cls(CHATML_TEMPLATE, bos_token=bos_token, eos_token=eos_token, is_fallback=True)
        raise FuselaneError(
            f"the GGUF has no chat template ({_TEMPLATE_KEY}) and its vocabulary is not ChatML; "
            "use plain completion instead of chat"
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages` (dicts with 'role' and 'content'), as HF's apply_chat_template makes it.

        `tools` are JSON schemas for templates that describe tools; `variables` are extra names some templates
        read (Qwen3's `enable_thinking`). A template that fails, refuses (`raise_exception`) or breaks the
        sandbox raises `FuselaneError` with a one-line message.
        """
        for message in messages:
            if not isinstance(message, Mapping):
                raise FuselaneError(f"a chat message must be a mapping with 'role' and 'content', not {message!r}")
        context = {
            **_plain(dict(variables or {})),
            "messages": _plain(list(messages)),
            "tools": _plain(list(tools)) if tools is not None else None,
            "documents": None,
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            pieces: list[str] = []
            length = 0
            for piece in self._template.generate(context):
                length += len(piece)
                if length > MAX_RENDERED_CHARS:
                    raise SecurityError(f"the rendered prompt exceeds {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
        except _TemplateRaised as exc:
            raise FuselaneError(f"chat template refused the conversation: {_one_line(exc.message or '')}") from None
        except SecurityError as exc:
            raise FuselaneError(f"chat template blocked by the sandbox: {_one_line(exc.message or '')}") from None
        except TemplateError as exc:
            raise FuselaneError(f"chat template failed: {_one_line(exc.message or '')}") from None
        except Exception as exc:  # a template can raise anything Python can: TypeError, OverflowError, ...
            raise FuselaneError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None
        return "".join(pieces)


def _token_text(meta: Mapping[str, Any], name: str, tokens: Sequence[str]) -> str:
    token_id = meta.get(f"tokenizer.ggml.{name}")
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else ""


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render and tokenize `messages`, reading control tokens only in the text the template wrote.

    How: the conversation is rendered twice, once as is and once with every message text replaced by a unique
    sentinel. The sentinel rendering shows which spans of the prompt are message text. Control tokens are cut
    out of the template's spans only (`Tokenizer.split_special`); everything between two control tokens,
    template text and message text together, is encoded as plain text. For messages that spell no control
    token this equals `tokenizer.encode(rendered, special=True)`, token for token.

    When the template transforms message text (trims it, escapes it, branches on it) the sentinels cannot be
    matched back. If no message spells a control token, the rendered prompt is then encoded directly, which
    is safe; otherwise this raises `FuselaneError` rather than let message text become control tokens.
    BOS is put in front when the file asks for it (`add_bos`) and the template did not write it.
    """
    rendered = template.render(messages, add_generation_prompt=add_generation_prompt)
    pieces = _split_by_sentinels(tokenizer, template, messages, add_generation_prompt, rendered)
    if pieces is None:
        if any(tokenizer.split_special(text) != [text] for text in _texts(messages)):
            raise FuselaneError(
                "a chat message spells a control token and this chat template rewrites message text, so it "
                "cannot be kept apart from the template's own tokens; remove the control token from it"
            )
        ids = tokenizer.encode(rendered, special=True)
    else:
        ids = _encode_pieces(tokenizer, pieces)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids


def _texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every piece of message text, in order: the content fields, and the text parts of multi-part content."""
    found: list[str] = []
    for message in messages:
        for name in _CONTENT_FIELDS:
            value = message.get(name)
            if isinstance(value, str):
                found.append(value)
            elif isinstance(value, list | tuple):
                found.extend(
                    part["text"] for part in value if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                )
    return found


def _with_sentinels(messages: Sequence[Mapping[str, Any]], make: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Copies of `messages` whose non-empty texts are sentinels from `make(n)`, and sentinel -> text."""
    texts: dict[str, str] = {}

    def swap(text: str) -> str:
        # An empty text stays empty: templates branch on `if message.content`, and a sentinel would flip that.
        if not text:
            return text
        sentinel = make(len(texts))
        texts[sentinel] = text
        return sentinel

    copies = []
    for message in messages:
        copy = dict(message)
        for name in _CONTENT_FIELDS:
            value = copy.get(name)
            if isinstance(value, str):
                copy[name] = swap(value)
            elif isinstance(value, list | tuple):
                copy[name] = [
                    {**part, "text": swap(part["text"])}
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                    else part
                    for part in value
                ]
        copies.append(copy)
    return copies, texts


def _split_by_sentinels(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    rendered: str,
) -> list[tuple[str, bool]] | None:
    """The prompt as (text, is_template_text) spans, or None if the template does not copy texts verbatim."""
    # Letters and digits only, so trimming, JSON escaping or HTML escaping would leave a sentinel as it is.
    nonce = secrets.token_hex(8)
    stem = f"FUSELANE{nonce}"
    if stem in rendered:
        return None
    copies, texts = _with_sentinels(messages, lambda n: f"{stem}N{n}X")
    with_sentinels = template.render(copies, add_generation_prompt=add_generation_prompt)
    parts = re.split(f"({stem}N[0-9]+X)", with_sentinels)
    found = parts[1::2]
    # Each text must come out exactly once, and putting the texts back must give the real rendering.
    if sorted(found) != sorted(texts):
        return None
    spans = [(part, index % 2 == 0) for index, part in enumerate(parts)]
    spans = [(texts[part] if not is_template else part, is_template) for part, is_template in spans]
    if "".join(text for text, _ in spans) != rendered:
        return None
    return [(text, is_template) for text, is_template in spans if text]


def _encode_pieces(tokenizer: Tokenizer, spans: list[tuple[str, bool]]) -> list[int]:
    """Control tokens from template spans; every run of text between them encoded as one plain string."""
    ids: list[int] = []
    run: list[str] = []
    for text, is_template in spans:
        for piece in tokenizer.split_special(text) if is_template else [text]:
            if isinstance(piece, int):
                if run:
                    ids.extend(tokenizer.encode("".join(run), special=False))
                    run.clear()
                ids.append(piece)
            else:
                run.append(piece)
    if run:
        ids.extend(tokenizer.encode("".join(run), special=False))
    return ids
