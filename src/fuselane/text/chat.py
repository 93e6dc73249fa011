"""Chat templates: the GGUF's own Jinja2 template, rendered in a sandbox, and tokenized without injection.

A chat template is code that came with a downloaded file, so it runs in a sandbox (`fuselane.text.sandbox`):
Jinja2's immutable sandbox, configured as Hugging Face's `apply_chat_template` configures Jinja so a template
renders here exactly as it renders there, and metered against a `RenderBudget` of time, steps, value sizes
and work (`fuselane.text.budget`), so a template that loops or builds without end stops in about a second.
Every failure is a one-line `FuselaneError`.

Tokenizing the rendered text is where a chat can be hijacked: a user message that spells `<|im_end|>` must not
end its turn. `encode_chat` therefore reads control tokens only in the text the template wrote, never in the
messages' content (see its docstring for how).
"""

from __future__ import annotations

import numbers
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

from fuselane.errors import FuselaneError
from fuselane.text.budget import BudgetExceeded, Meter, RenderBudget, activate, deactivate
from fuselane.text.sandbox import TemplateRaised, environment
from fuselane.text.utf8 import PromptTooLong, require_utf8

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

# Real templates are a few to a few tens of kB. Jinja compiles about 100 kB a second and compiling is not
# metered, so a template's source is capped at about a second of it.
MAX_TEMPLATE_CHARS = 128 * 1024
# What Jinja may build while it folds constant expressions at compile time; a larger fold is left to the render.
_COMPILE_BUDGET = RenderBudget(value_units=1 << 16, work_units=1 << 20)
_UNBOUNDED = 1 << 62  # measuring the conversation itself is not the template's work
MAX_MESSAGE_CHARS = 300  # of a template's error message, which may quote anything the template built

# Message fields holding text a person or the model wrote: these never become control tokens.
_CONTENT_FIELDS = ("content", "reasoning_content", "thinking")


def _one_line(text: object) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS] + "..."


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

    __slots__ = ("source", "bos_token", "eos_token", "is_fallback", "budget", "_template")

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        is_fallback: bool = False,
        budget: RenderBudget | None = None,
    ):
        """Compile `source`; a template that does not parse raises `FuselaneError`. `budget` bounds each render
        (default `RenderBudget()`)."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        self.budget = budget or RenderBudget()
        if len(source) > MAX_TEMPLATE_CHARS:
            raise FuselaneError(
                f"chat template is {len(source)} characters, more than the {MAX_TEMPLATE_CHARS} a template may be"
            )
        # Jinja folds constant expressions while it compiles: a metered compile refuses (and leaves to the
        # render, which refuses again) any fold that would build too much.
        token = activate(Meter(_COMPILE_BUDGET))
        try:
            self._template = environment().from_string(source)
        except TemplateSyntaxError as exc:
            raise FuselaneError(
                f"chat template does not parse (line {exc.lineno}): {_one_line(exc.message or '')}"
            ) from None
        except Exception as exc:  # the parser itself can fail on hostile input, e.g. RecursionError
            raise FuselaneError(f"chat template does not compile: {type(exc).__name__}: {_one_line(exc)}") from None
        finally:
            deactivate(token)

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
        max_chars: int | None = None,
    ) -> str:
        """The prompt for `messages` (dicts with 'role' and 'content'), as HF's apply_chat_template makes it.

        `tools` are JSON schemas for templates that describe tools; `variables` are extra names some templates
        read (Qwen3's `enable_thinking`). A template that fails, refuses (`raise_exception`), breaks the
        sandbox or runs past its budget raises `FuselaneError` with a one-line message. `max_chars` bounds the
        prompt's length (the context's bound, see `encode_chat`): past it, `PromptTooLong` is raised as soon as
        the template has written that much.
        """
        _check_messages(messages)
        try:
            context = {
                **_plain(dict(variables or {})),
                "messages": _plain(list(messages)),
                "tools": _plain(list(tools)) if tools is not None else None,
                "documents": None,
                "add_generation_prompt": bool(add_generation_prompt),
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
            }
            # A long conversation may be built on and written several times over; the budget grows with it.
            meter = Meter(
                self.budget.scaled(Meter(RenderBudget(work_units=_UNBOUNDED, depth=_UNBOUNDED)).size(context))
            )
        except (RecursionError, BudgetExceeded):
            raise FuselaneError("the conversation is nested too deeply to render") from None
        limit = meter.budget.output_chars
        token = activate(meter)
        try:
            pieces: list[str] = []
            length = 0
            for piece in self._template.generate(context):
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise PromptTooLong(
                        f"the chat prompt is longer than the {max_chars} characters the context can hold"
                    )
                if length > limit:
                    raise BudgetExceeded(f"it wrote more than {limit} characters")
                pieces.append(piece)
        except PromptTooLong:
            raise
        except TemplateRaised as exc:
            raise FuselaneError(f"chat template refused the conversation: {_one_line(exc.message or '')}") from None
        except BudgetExceeded as exc:
            raise FuselaneError(f"chat template stopped: {_one_line(exc.message or '')}") from None
        except SecurityError as exc:
            raise FuselaneError(f"chat template blocked by the sandbox: {_one_line(exc.message or '')}") from None
        except TemplateError as exc:
            raise FuselaneError(f"chat template failed: {_one_line(exc.message or '')}") from None
        except Exception as exc:  # a template can raise anything Python can: TypeError, OverflowError, ...
            raise FuselaneError(f"chat template failed: {type(exc).__name__}: {_one_line(exc)}") from None
        finally:
            deactivate(token)
        return "".join(pieces)


def _check_messages(messages: Sequence[Any]) -> None:
    for message in messages:
        if not isinstance(message, Mapping):
            raise FuselaneError(f"a chat message must be a mapping with 'role' and 'content', not {_one_line(message)}")


def _token_text(meta: Mapping[str, Any], name: str, tokens: Sequence[str]) -> str:
    token_id = meta.get(f"tokenizer.ggml.{name}")
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else ""


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    limit: int | None = None,
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

    `limit` (the context's size) bounds the prompt before it is tokenized whole: messages or a rendering of more
    than `limit * tokenizer.max_token_bytes` characters are refused unrendered or untokenized, and tokenizing
    stops past `limit` tokens (`PromptTooLong`, see `Tokenizer.encode`).
    """
    _check_messages(messages)
    texts = _texts(messages)
    for text in texts:
        require_utf8(text, "a chat message")
    bound = None if limit is None else limit * tokenizer.max_token_bytes
    if bound is not None and sum(map(len, texts)) > bound:
        raise PromptTooLong(
            f"the chat messages are {sum(map(len, texts))} characters, more than {limit} tokens of at most "
            f"{tokenizer.max_token_bytes} bytes can hold: the prompt is past the context of {limit}"
        )
    try:
        rendered = template.render(messages, add_generation_prompt=add_generation_prompt, max_chars=bound)
    except PromptTooLong:
        raise PromptTooLong(
            f"the chat prompt is more than {bound} characters, more than {limit} tokens can hold: "
            f"past the context of {limit}"
        ) from None
    pieces = _split_by_sentinels(tokenizer, template, messages, add_generation_prompt, rendered)
    if pieces is None:
        if any(tokenizer.split_special(text) != [text] for text in texts):
            raise FuselaneError(
                "a chat message spells a control token and this chat template rewrites message text, so it "
                "cannot be kept apart from the template's own tokens; remove the control token from it"
            )
        ids = tokenizer.encode(rendered, special=True, limit=limit)
    else:
        ids = _encode_pieces(tokenizer, pieces, limit)
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


def _encode_pieces(tokenizer: Tokenizer, spans: list[tuple[str, bool]], limit: int | None) -> list[int]:
    """Control tokens from template spans; every run of text between them encoded as one plain string, each
    within what is left of `limit`."""
    ids: list[int] = []
    run: list[str] = []

    def flush() -> None:
        left = None if limit is None else limit - len(ids)
        if left is not None and left < 0:
            raise PromptTooLong(f"the prompt is more than {limit} tokens, past the context of {limit}")
        try:
            ids.extend(tokenizer.encode("".join(run), special=False, limit=left))
        except PromptTooLong:
            raise PromptTooLong(f"the prompt is more than {limit} tokens, past the context of {limit}") from None
        run.clear()

    for text, is_template in spans:
        for piece in tokenizer.split_special(text) if is_template else [text]:
            if isinstance(piece, int):
                if run:
                    flush()
                ids.append(piece)
            else:
                run.append(piece)
    if run:
        flush()
    if limit is not None and len(ids) > limit:
        raise PromptTooLong(f"the prompt is more than {limit} tokens, past the context of {limit}")
    return ids
