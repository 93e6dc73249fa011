"""Time a decode step's delta rule with its output's gated norm at Qwen3-Next-80B-A3B's widths: the step then the
norm's own launch (the int8 form in its store), against the step norming its output in its launch
(`norm_in_step`), each a dependent launch replayed from a CUDA graph over `COPIES` states in turn (together past
the L2, as a step's 36 linear layers read theirs). Prints both, and how far the two agree.

Usage: python benchmarks/gdn_step_norm.py   (on a GPU)
"""

from __future__ import annotations

import torch

from benchmarks.gemv_compare import timed_in_turn
from fuselane.lanes.cuda.triton import pdl, quant
from fuselane.lanes.cuda.triton.gdn import delta, norm

V_HEADS, K_HEADS, DK, DV = 32, 16, 128, 128  # the 80B-A3B's linear layers
COPIES = 12  # states a graph cycles through: 12 x 2 MB
REPS = 240
EPS = 1e-6


def main() -> None:
    torch.manual_seed(0)
    per = V_HEADS // K_HEADS
    q = torch.randn(1, K_HEADS * DK, device="cuda")
    k = torch.nn.functional.normalize(torch.randn(K_HEADS, DK, device="cuda"), dim=-1).reshape(1, -1)
    v, z = torch.randn(1, V_HEADS * DV, device="cuda"), torch.randn(1, V_HEADS * DV, device="cuda")
    flat = torch.randn(K_HEADS * 2 * per, device="cuda")
    b_view = flat.as_strided((K_HEADS, per), (2 * per, 1))
    a_view = flat[per:].as_strided((K_HEADS, per), (2 * per, 1))
    dt, decay = torch.randn(V_HEADS, device="cuda"), -torch.exp(torch.randn(V_HEADS, device="cuda"))
    raw = delta.Raw(b_view, a_view, dt, decay)
    w = torch.randn(DV, device="cuda")
    states = [torch.randn(V_HEADS, DK, DV, device="cuda") * 0.01 for _ in range(COPIES)]
    o, y = torch.empty(1, V_HEADS * DV, device="cuda"), torch.empty(1, V_HEADS * DV, device="cuda")
    q8s = [quant.empty_q8(1, V_HEADS * DV, "cuda") for _ in range(2)]
    shape = dict(rows=1, heads=V_HEADS, key_heads=K_HEADS, dk=DK, dv=DV, scale=DK**-0.5, write_state=True)

    def apart(s: torch.Tensor) -> None:
        delta.delta(q, k, v, raw, None, s, o, **shape)
        norm.gated_norm(o, w, z, y, units=V_HEADS, d=DV, eps=EPS, out_q8=q8s[0])

    def normed(s: torch.Tensor) -> None:
        delta.delta(q, k, v, raw, None, s, y, normed=delta.Normed(w, z, EPS, q8s[1]), **shape)

    first, second = states[0].clone(), states[0].clone()
    apart(first)
    y_apart = y.clone()
    normed(second)
    diff = (y - y_apart).abs().max().item()
    codes = (q8s[0].q != q8s[1].q).sum().item()
    print(f"output {diff:.1e} apart (of {y_apart.abs().max().item():.2f}), {codes} codes differ, state "
          f"{(first - second).abs().max().item():.1e} apart", flush=True)  # fmt: skip
    with pdl.dependent_launches(True):
        for rep in range(2):
            for name, fn in (("the step, then the norm's launch", apart), ("the step norming its output", normed)):
                took = timed_in_turn([lambda s=s, fn=fn: fn(s) for s in states], REPS)
                print(f"{name:34} {took * 1e6:6.2f} us a layer (round {rep})", flush=True)


if __name__ == "__main__":
    main()
