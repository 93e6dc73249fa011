"""What the loader does with a file's bytes, stage by stage: shared by the fuzz target and the property tests.

`read_like_fuselane` takes bytes through everything `info`, `run` and `tokenize` do before any weight is
computed on: the reader's checks (`check_layout`: the bounded header scan, the metadata key types, tensor
placement), the model config with its weight checks and the `info` summary, the tokenizer (built and used
once) and the chat template (compiled and rendered once). A `FuselaneError` is the expected way for any stage
to refuse the input; anything else propagates, and is a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.gguf.reader import GgufFile, check_layout
from fuselane.info import render, summarize
from fuselane.text.chat import ChatTemplate
from fuselane.text.tokenizer import Tokenizer

NAME = "fuzz.gguf"  # what the error messages call the input
SAMPLE_TEXT = "Hello, world! <|im_end|> 12345"
SAMPLE_CHAT = ({"role": "user", "content": "hi"},)


def _attempt(step: Callable[[], object]) -> str:
    """Run one stage: 'ok', or 'refused' if it raised a FuselaneError (anything else propagates)."""
    try:
        step()
    except FuselaneError:
        return "refused"
    return "ok"


def read_like_fuselane(data: bytes) -> dict[str, str]:
    """Each stage's outcome ('ok' or 'refused') for a file holding `data`; stages past a refused read are absent."""
    try:
        layout = check_layout(data, len(data), NAME)
    except FuselaneError:
        return {"read": "refused"}
    tensors = layout.views(np.frombuffer(data, dtype=np.uint8))
    header = layout.header
    meta = header.metadata
    f = GgufFile(Path(NAME), header.version, len(data), layout.alignment, meta, tensors)
    return {
        "read": "ok",
        "info": _attempt(lambda: render(summarize(f))),
        "tokenizer": _attempt(lambda: Tokenizer.from_metadata(meta).encode(SAMPLE_TEXT, special=True)),
        "template": _attempt(lambda: ChatTemplate.from_metadata(meta).render(list(SAMPLE_CHAT))),
    }
