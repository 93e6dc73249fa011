"""The feed-forward tensors of a synthetic checkpoint, as llama.cpp's converter names and shapes them (GGUF
lists the innermost dimension first; these shapes are outermost first, as NumPy holds them). Shared by every
architecture `synth` writes, so a dense, a mixture and a shared expert have one spelling."""

from __future__ import annotations

Shapes = dict[str, tuple[int, ...]]


def dense(b: str, d: int, ff: int) -> Shapes:
    """A SwiGLU block: gate and up (ff, d), down (d, ff)."""
    return {b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d), b + "ffn_down.weight": (d, ff)}


def experts(b: str, d: int, e: int, ff: int) -> Shapes:
    """A mixture's router (e, d) and its 3-D experts, the expert outermost."""
    return {
        b + "ffn_gate_inp.weight": (e, d),
        b + "ffn_gate_exps.weight": (e, ff, d),
        b + "ffn_up_exps.weight": (e, ff, d),
        b + "ffn_down_exps.weight": (e, d, ff),
    }


def shared_expert(b: str, d: int, sff: int, *, gated: bool) -> Shapes:
    """The shared expert's SwiGLU block (sff wide), with its sigmoid gate's row (d,) where `gated`."""
    gate: Shapes = {b + "ffn_gate_inp_shexp.weight": (d,)} if gated else {}
    return gate | {
        b + "ffn_gate_shexp.weight": (sff, d),
        b + "ffn_up_shexp.weight": (sff, d),
        b + "ffn_down_shexp.weight": (d, sff),
    }
