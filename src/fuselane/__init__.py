"""fuselane: compile quantized GGUF checkpoints into fused kernel plans and run generation on them.

`fuselane.load(path_or_name, lane="cpu")` returns a model with `stream`, `generate`, `chat` and `logits`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["load", "__version__"]


def __getattr__(name: str) -> Any:
    # The runtime loads on first use, so `import fuselane` (and the CLI's start) stays cheap.
    if name == "load":
        from fuselane.runtime.model import load

        return load
    raise AttributeError(f"module 'fuselane' has no attribute {name!r}")
