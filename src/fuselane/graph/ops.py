"""Primitive op specs: what one unfused step of a model computes, with the shapes it computes it at.

A spec is a small frozen dataclass; an op of the graph carries one as its symbol. Shapes are concrete for a
graph's form (a decode step is one row, a prefill chunk `rows` rows). Conventions: activations are row-major
`(rows, cols)`; a product multiplies `x (m, k)` by checkpoint rows `W (n, k)` into `y (m, n)`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class ElementwiseOp(enum.Enum):
    ADD = "add"
    MUL = "mul"


class UnaryOp(enum.Enum):
    SILU = "silu"
    SIGMOID = "sigmoid"
    SOFTPLUS = "softplus"  # log(1 + exp(x)): a delta rule's decay


@dataclass(frozen=True, slots=True)
class RowsGather:
    """out[i] = table[ids[i]]: the embedding lookup. ins: table (vocab, cols), ids (rows,)."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class RmsNorm:
    """out = x / sqrt(mean(x^2) + eps) over each `cols`-wide unit; `rows` units (rows * heads for per-head)."""

    rows: int
    cols: int
    eps: float


@dataclass(frozen=True, slots=True)
class Elementwise:
    """out = a (op) b; with `row` the second operand is one `cols`-wide row broadcast over every unit."""

    op: ElementwiseOp
    rows: int
    cols: int
    row: bool = False


@dataclass(frozen=True, slots=True)
class Unary:
    """out = f(x) elementwise."""

    op: UnaryOp
    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class Matmul:
    """y (m, n) = x (m, k) @ W (n, k)^T: a product by a weight stored as checkpoint rows (a GEMV when m == 1)."""

    m: int
    n: int
    k: int


YARN_MIN_RAMP = 1e-3  # ggml's floor on YaRN's ramp width, where both ends fall on one frequency


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN's stretch of the rotary frequencies: each frequency is interpolated by `factor`, extrapolated, or a
    mix of both, by where its wavelength falls between the `beta_fast` and `beta_slow` turns over the
    `original` context the model was trained at (ggml's and Hugging Face's reading)."""

    factor: float
    original: int
    beta_fast: float
    beta_slow: float

    def ramp(self, hd: int, base: float) -> tuple[int, float]:
        """(low, width) of the ramp over a head of `hd` values' hd/2 frequencies: frequency j keeps its value
        below `low`, is divided by the factor past low + width, and mixes the two by (j - low) / width between
        (the pair index whose frequency turns `beta_fast` times over the original context, floored, and the
        one turning `beta_slow` times, ceiled; ggml's floor on the width where both fall on one frequency)."""

        def dim_of(turns: float) -> float:
            return hd * math.log(self.original / (turns * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_of(self.beta_fast)), 0)
        high = min(math.ceil(dim_of(self.beta_slow)), hd - 1)
        return low, max(YARN_MIN_RAMP, high - low)


@dataclass(frozen=True, slots=True)
class Rope:
    """Rotary position embedding of `heads` heads of `hd` values in each of `rows` rows, the i-th row at
    position pos + i (ins: x, pos). `half` pairs value j with j + rot/2 (NEOX order, as Qwen rotates);
    otherwise value 2j with 2j + 1 (DeepSeek's order). Only the first `rot` values of a head turn (partial
    rotary), the rest pass. `yarn` stretches the frequencies (DeepSeek-V3)."""

    rows: int
    heads: int
    hd: int
    base: float
    half: bool = True
    batched: bool = False  # each row is its own sequence, at its own position (pos is a vector)
    rot: int = 0  # values of a head that turn; 0: all `hd`
    yarn: Yarn | None = None

    @property
    def turned(self) -> int:
        return self.rot or self.hd


@dataclass(frozen=True, slots=True)
class SetRow:
    """Write `rows` rows of `cols` values into a table at rows pos .. pos + rows - 1 (ins: x, pos); the op's
    destination names the table and the row. `batched`: row i is sequence i's, written at pos[i] of that
    sequence's `seq_rows`-row block of the table."""

    rows: int
    cols: int
    batched: bool = False
    seq_rows: int = 0


@dataclass(frozen=True, slots=True)
class Attention:
    """Causal grouped-query attention of `rows` query rows at positions pos .. pos + rows - 1 over the first
    pos + rows rows of the key and value caches (ins: q (rows, heads*hd), k cache, v cache, pos); the cache
    holds `len` rows of `kv_heads * hd`. Query head h reads key/value head h // (heads // kv_heads)."""

    rows: int
    heads: int
    kv_heads: int
    hd: int
    len: int
    scale: float
    vd: int = 0  # value width; 0 means hd
    ext: AttentionExt | None = None
    batched: bool = False  # row i is sequence i's query at pos[i], over its own `len`-row block of the caches

    @property
    def value_width(self) -> int:
        return self.vd or self.hd


@dataclass(frozen=True, slots=True)
class TakeRows:
    """The last `take` of `rows` rows: a prefill chunk needs logits only for the row that samples."""

    rows: int
    cols: int
    take: int


# The specs below are the vocabulary of the families past the dense Qwen ones: mixtures of experts (emitted by
# the qwen2moe / qwen3moe recognizer), and hybrid recurrent layers, latent attention and soft-capped attention,
# whose recognizers come next (the optimizer's views and the lanes' shims already answer for them).


class Gating(enum.Enum):
    """How a router turns its scores into routing probabilities."""

    SOFTMAX = "softmax"  # over every expert
    SIGMOID = "sigmoid"  # each expert on its own (DeepSeek-V3)


class GateAct(enum.Enum):
    SILU = "silu"
    SIGMOID = "sigmoid"


class MoeAct(enum.Enum):
    SWIGLU = "swiglu"
    GELU = "gelu"


@dataclass(frozen=True, slots=True)
class AttentionExt:
    """Attention features beyond the dense Qwen form: soft-capped scores, sink logits, a sliding window, and a
    value width other than the key width (latent attention)."""

    softcap: float | None = None
    sinks: bool = False
    window: int | None = None


@dataclass(frozen=True, slots=True)
class Softcap:
    """out = cap * tanh(x / cap)."""

    rows: int
    cols: int
    cap: float


@dataclass(frozen=True, slots=True)
class HeadMatmul:
    """Per-head product: each of `heads` heads of each of `m` rows, `a` values wide, times its own (b, a) matrix."""

    m: int
    heads: int
    a: int
    b: int


@dataclass(frozen=True, slots=True)
class Moe:
    """The mixture's result: each of `rows` rows sums its `k` kept experts' outputs (`d` wide), each weighted by
    its routing probability (ins: expert outputs (rows * k, d), weights (rows, k)). The spec also carries the
    mixture's size (`experts` experts, each `dff` wide, its activation), which the lanes size launches by."""

    rows: int
    d: int
    dff: int
    experts: int
    k: int
    act: MoeAct = MoeAct.SWIGLU


@dataclass(frozen=True, slots=True)
class TopK:
    """The indices of each row's `k` largest of `cols` router scores, largest first (the first on a tie):
    ins: scores (rows, cols); out: (rows, k) i32."""

    rows: int
    cols: int
    k: int


@dataclass(frozen=True, slots=True)
class RouteWeights:
    """Each kept expert's routing weight: the softmax of a row's `experts` router scores at the kept indices
    (the sigmoid of each, under `Gating.SIGMOID`), renormalised to sum to one over the `k` kept where `renorm`,
    then times `scale` (ins: scores (rows, experts), ids (rows, k))."""

    rows: int
    experts: int
    k: int
    renorm: bool
    gating: Gating = Gating.SOFTMAX
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class ExpertChoice:
    """The scores a router chooses its experts by, where they are not its raw scores: the routing
    probabilities (`gating` of each row's `experts` scores), plus a per-expert correction bias where `bias`
    (DeepSeek-V3's `exp_probs_b`). ins: scores (rows, experts)[, bias (experts,)]; out (rows, experts)."""

    rows: int
    experts: int
    gating: Gating
    bias: bool


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """Top-k within the best groups: the `experts` are `groups` runs of equal length; a group scores the sum of
    its two best choice scores, each row keeps its `used` best groups, then its `k` best experts among them,
    best first (the lower index first on a tie). ins: choice scores (rows, experts); out: (rows, k) i32."""

    rows: int
    experts: int
    k: int
    groups: int
    used: int


@dataclass(frozen=True, slots=True)
class ExpertSort:
    """A chunk's (row, slot) pairs ordered by the expert each routes to, stably (ins: ids (rows, k); out:
    (rows * k,) i32 pair indices), so each expert's rows are multiplied together."""

    rows: int
    k: int
    experts: int


@dataclass(frozen=True, slots=True)
class ExpertMatmul:
    """Each (row, slot) pair's product by its expert's matrix: y[p] (n) = x[p] (kd) @ W[ids[p]] (n, kd)^T,
    ins: x, W (experts, n, kd) checkpoint rows, ids (rows, k)[, order from ExpertSort]. `slotted`: x has a row
    a pair (rows * k, kd), the down product's; otherwise one a row, read by each of its k pairs. out:
    (rows * k, n). Only the kept experts' rows are read."""

    rows: int
    k: int
    n: int
    kd: int
    slotted: bool = False


@dataclass(frozen=True, slots=True)
class RowScale:
    """out = x * s, each row of `cols` values times its own scalar (ins: x (rows, cols), s (rows, 1)): the
    shared expert's sigmoid gate."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class CausalConv:
    """Depth-wise causal convolution of `chan` channels with `taps` taps over `rows` rows: row t of channel c
    is sum_j w[c, j] * x[t - taps + 1 + j, c], the rows before the first read from the state (ins: x (rows,
    chan), state (taps - 1, chan): the sequence's last inputs, weight (chan, taps))."""

    rows: int
    chan: int
    taps: int


@dataclass(frozen=True, slots=True)
class ConvShift:
    """A convolution's state after `rows` more rows: the last `keep` rows of the old state followed by x
    (ins: x (rows, chan), state (keep, chan); the op writes the state)."""

    rows: int
    chan: int
    keep: int


@dataclass(frozen=True, slots=True)
class L2Norm:
    """x / sqrt(sum(x^2) + eps) over each `cols`-wide unit of `rows` units."""

    rows: int
    cols: int
    eps: float


@dataclass(frozen=True, slots=True)
class GatedDelta:
    """The gated delta rule over `rows` rows of `heads` value heads (values `dv` wide), each reading key head
    h // (heads // k_heads) (keys `dk` wide): per row, S = S * exp(g); S += k (beta (v - S^T k))^T; the
    output is S^T q * `scale` (ins: q, k (rows, k_heads * dk), v (rows, heads * dv), g, beta (rows, heads),
    state (heads, dk, dv)). A chunk of rows may be computed in the chunked form, the same numbers within
    rounding. `gate` names the activation that gates the rule's output downstream (SiLU for Qwen3-Next)."""

    rows: int
    heads: int
    dk: int
    dv: int
    gate: GateAct = GateAct.SILU
    k_heads: int = 0  # key heads (0: one a value head)
    scale: float = 1.0

    @property
    def key_heads(self) -> int:
        return self.k_heads or self.heads


@dataclass(frozen=True, slots=True)
class DeltaState:
    """The gated delta rule's state after its `rows` rows (the ins and shapes of `GatedDelta`'s spec `rule`,
    without the query); the op writes the state."""

    rule: GatedDelta


@dataclass(frozen=True, slots=True)
class Join:
    """Each of `heads` heads of each row: `wa / heads` values of the first input then `wb / heads` of the second."""

    rows: int
    heads: int
    wa: int
    wb: int


@dataclass(frozen=True, slots=True)
class Slice:
    """`width` values at `start` of every `every`-wide unit of `groups` units."""

    groups: int
    every: int
    start: int
    width: int


@dataclass(frozen=True, slots=True)
class ArgMax:
    """The index of each row's largest value: the greedy pick of the next token."""

    rows: int
    cols: int


@dataclass(frozen=True, slots=True)
class Quantize:
    """x's int8 form for the products that read it quantized, where its producer wrote it in f32 only: `rows`
    units of `cols` values, each 32-value block under its own scale. A lane adds it (no model emits it)."""

    rows: int
    cols: int


PrimSpec = (
    RowsGather
    | RmsNorm
    | Elementwise
    | Unary
    | Matmul
    | Rope
    | SetRow
    | Attention
    | TakeRows
    | ArgMax
    | Softcap
    | HeadMatmul
    | Moe
    | TopK
    | ExpertChoice
    | GroupedTopK
    | RouteWeights
    | ExpertSort
    | ExpertMatmul
    | RowScale
    | CausalConv
    | ConvShift
    | L2Norm
    | GatedDelta
    | DeltaState
    | Join
    | Slice
    | Quantize
)
