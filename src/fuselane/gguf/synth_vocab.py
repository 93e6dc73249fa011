"""A synthetic byte-level BPE tokenizer, as GGUF tokenizer metadata, for synthetic checkpoints.

Synthetic checkpoints need a tokenizer that every consumer (fuselane's own text layer, Hugging Face
`tokenizers`, llama.cpp) accepts, of exactly the model's vocabulary size, without shipping a real one. This
builds a GPT-2 style byte-level BPE: the 256 byte symbols, then merged tokens, then Qwen's special tokens.

Why the merged tokens are guaranteed reachable: the byte symbols are split into *heads* (all but the
lowercase ASCII letters) and *tails* (the 26 lowercase letters). Every merged token is a head followed by one
or more tails, and its merge is (the token minus its last letter, that letter), so the merged tokens form a
trie grown level by level. In such a set the only mergeable pair in a word is the growing head-prefix and the
tail after it (tail+tail and anything+head are never merges), so BPE rebuilds every merged token from its
bytes, one letter at a time, in rank order. Building the 151,936-token Qwen vocabulary takes about 0.2 s.
"""

from __future__ import annotations

import string
from functools import cache
from typing import Any

import numpy as np
from gguf import TokenType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_SYMBOLS = 256
MIN_VOCAB = BYTE_SYMBOLS + len(SPECIAL_TOKENS)
TAILS = tuple(string.ascii_lowercase)

# ChatML, as the Qwen instruct models use it (without the tool-calling branches of the real template).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@cache
def byte_symbols() -> tuple[str, ...]:
    """GPT-2's `bytes_to_unicode` symbols in its order (printable bytes first), the first 256 token ids."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    # The other bytes (controls, space, ...) are shifted past 255 so that every symbol is visible.
    shifted = [b for b in range(BYTE_SYMBOLS) if b not in set(printable)]
    return tuple(chr(b) for b in printable) + tuple(chr(BYTE_SYMBOLS + n) for n in range(len(shifted)))


def merged_tokens(count: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """`count` (left, right) merges, in rank order, whose concatenations are new, reachable tokens."""
    tails = set(TAILS)
    level = [s for s in byte_symbols() if s not in tails]  # the heads: one-symbol prefixes
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        candidates = [(prefix, tail) for prefix in level for tail in TAILS]
        take = min(count - len(merges), len(candidates))
        # A seeded random subset of the next trie level, in random rank order; parents are all of lower rank.
        chosen = [candidates[i] for i in rng.permutation(len(candidates))[:take]]
        merges.extend(chosen)
        level = [left + right for left, right in chosen]
    return merges


def synthetic_tokenizer(vocab: int, seed: int = 0) -> dict[str, Any]:
    """GGUF tokenizer metadata of a valid byte-level BPE with exactly `vocab` tokens.

    Token ids: the 256 byte symbols, then merged tokens (see the module docstring), then the control tokens
    <|endoftext|> (bos and padding), <|im_start|> and <|im_end|> (eos), as in Qwen2.5's instruct files, with
    a ChatML chat template. `seed` picks which merged tokens exist. Raises ValueError below 259 tokens.
    """
    if vocab < MIN_VOCAB:
        raise ValueError(f"a synthetic vocabulary needs at least {MIN_VOCAB} tokens (bytes and specials), not {vocab}")
    merges = merged_tokens(vocab - MIN_VOCAB, np.random.default_rng(seed))
    tokens = [*byte_symbols(), *(left + right for left, right in merges), *SPECIAL_TOKENS]
    first_special = vocab - len(SPECIAL_TOKENS)
    types = [int(TokenType.NORMAL)] * first_special + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    ids = {tok: first_special + i for i, tok in enumerate(SPECIAL_TOKENS)}
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    if merges:  # GGUF arrays cannot be empty; a bytes-only vocabulary simply has no merges key
        meta["tokenizer.ggml.merges"] = [f"{left} {right}" for left, right in merges]
    return meta
