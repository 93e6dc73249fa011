"""The cuda lane's knobs: which chip it compiles for and the numerics it runs at.

A knob is set on the command line as `--knob key=value` (`CudaKnobs.parse`). The numerics knobs say how
products read their activations (dequantized values, or int8 words under a scale a 32-value block, one word a
value or two), the precision of the KV cache and of a hybrid model's recurrent state, and
whether producers quantize their result in their own epilogue (`fuse_quant`). `batch` compiles a form whose
rows are a batch's sequences, each its own row, rather than one sequence's rows.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace

from fuselane.errors import FuselaneError

KIB = 1024


@dataclass(frozen=True, slots=True)
class Chip:
    """The facts of a GPU the kernels are sized by: streaming multiprocessors, and the shared memory one
    thread block may claim (the opt-in maximum, in KiB)."""

    name: str
    sms: int
    smem_kib_per_block: int

    @property
    def smem_bytes_per_block(self) -> int:
        return self.smem_kib_per_block * KIB


# Chips by the name `--knob chip=NAME` takes. SM counts and the opt-in shared memory per block are NVIDIA's
# (CUDA programming guide, compute capability tables): Hopper and Ada 227 / 99 KiB, Ampere A100 163 KiB.
H200 = Chip("H200", 132, 227)
CHIPS: dict[str, Chip] = {
    "h200": H200,
    "h100": Chip("H100", 132, 227),
    "a100": Chip("A100", 108, 163),
    "l40s": Chip("L40S", 142, 99),
    "rtx4090": Chip("RTX4090", 128, 99),
}


class Activations(enum.Enum):
    """How a product by checkpoint rows reads its activation (the numerics contract's scheme)."""

    DEQUANT = "dequant"  # f32 activations; the kernel decodes the weights to floats
    INT8 = "int8"  # one int8 word a value under a scale a 32-value block
    INT8X2 = "int8x2"  # two words: the second holds the first's rounding error


class PrefillWeights(enum.Enum):
    """How a prefill chunk's products (past the GEMV's rows) read the weights."""

    INT8 = "int8"  # the int8 tensor-core GEMM on the checkpoint's bytes and the activation's int8 form; no copy
    F16_COPY = "f16-copy"  # cuBLAS on an f16 copy of each matrix, made on first use (3.6x a Q4_K matrix's bytes)
    IN_PLACE = "in-place"  # the f16 tensor-core GEMMs that decode the checkpoint's bytes in the kernel; no copy
    # cuBLAS on each matrix decoded to f16 just before its product, into one scratch (`kernels.F16_SCRATCH_VALUES`)
    F16_SCRATCH = "f16-scratch"
    # f16-scratch for a sequence's chunks; for a batch's steps f16-copy where the copies fit in the GPU's free
    # memory beside the weights, the cache and a workspace, else f16-scratch (`run/lane.prefill_for`)
    AUTO = "auto"

    @property
    def cublas(self) -> bool:
        """Whether a chunk's products multiply f16 matrices with cuBLAS (copies, or decoded into the scratch)
        rather than decode the checkpoint's bytes in their own kernel."""
        return self in (PrefillWeights.F16_COPY, PrefillWeights.F16_SCRATCH, PrefillWeights.AUTO)


class DeltaProducts(enum.Enum):
    """How the chunked gated delta rule (a prefill chunk of a hybrid's linear layers) multiplies."""

    IEEE = "ieee"  # f32 products as FMA loops: the recurrence's numbers within f32 roundoff
    TF32X3 = "tf32x3"  # three TF32 tensor-core products a step (the low halves' product dropped): about f32's


class RopeEpilogue(enum.Enum):
    """Where an int8 decode step's query and key rotations run: in the QKV GEMV's epilogue or a launch after."""

    AUTO = "auto"  # in the epilogue where the layer would otherwise take 8 launches (see CudaKnobs)
    ON = "on"  # in the epilogue wherever the GEMV's tile allows
    OFF = "off"  # a launch of their own after the GEMV


class DependentLaunch(enum.Enum):
    """Whether each of a step's launches is a dependent of the one before it (`triton/pdl.py`)."""

    AUTO = "auto"  # on, but where a dense product's matrix is in a grid format (`kernels.dependent_launch_pays`)
    ON = "on"
    OFF = "off"


class WeightLoads(enum.Enum):
    """How the int8 decode GEMVs issue a chunk's weight loads ahead of the sums before it
    (`triton/gemv/weight_loads.py`)."""

    AS_WRITTEN = "as-written"  # read-only loads (ld.global.nc), placed where ptxas puts them
    AHEAD = "ahead"  # coherent loads held ahead by the prefetch's bar.sync; the same numbers


class CachePrecision(enum.Enum):
    F32 = "f32"
    F16 = "f16"


class StatePrecision(enum.Enum):
    F32 = "f32"
    BF16 = "bf16"


class RoundInPlace(enum.Enum):
    """Whether a chunk's product rounds an activation no later op reads into its own bytes (`f16_scale`)."""

    AUTO = "auto"  # where the workspace share takes fewer slabs for it (`run/workspace`)
    ON = "on"
    OFF = "off"


class LatentDecode(enum.Enum):
    """Which kernel a decode step's absorbed latent attention (DeepSeek's) runs on."""

    CORES = "cores"  # f32 products on the CUDA cores (`triton/mla/attention.py`), under any numerics
    PACKED = "packed"  # under int8 a row's heads the rows of f16 tensor-core products (`triton/mla/packed.py`)


@dataclass(frozen=True, slots=True)
class CudaKnobs:
    """The lane's knobs.

    Defaults, and why:
    - `activations=int8`: a decode step's products multiply int8 codes of their activation with dp4a, as
      llama.cpp's do (q8_1). With f32 activations a 4-bit weight costs ~6.8 instructions, which holds the
      GEMVs to 1-2 TB/s; dp4a cuts that to about one (H200 decode 1.28-1.75x faster, `benchmarks/RESULTS.md`).
      A chunk's attention multiplies on the f16 tensor cores (`CudaShim.attention`), and so does a decode
      step's, a key/value group's heads packed into one product's rows (`CudaShim.packs_gqa_rows`: a long
      context's cache read once a step); its products multiply
      f16 copies of the matrices by default (`prefill`, below). The contract's tolerance is wider: `dequant`
      keeps the lane's numbers closest to the cpu reference (the tightest contract), at the slower decode.
      `int8x2` has no kernels here.
    - `cache=f16`: halves the bytes a long context's attention reads, at f16's 2^-11 roundoff, the error
      attention already tolerates (the lane keeps its caches in f32 or f16; llama.cpp in f16).
    - `state=f32`: a recurrent state is summed into every step, so its rounding compounds; keep it exact.
    - `fuse_quant=True`: under quantized activations a producer writes its result already quantized, which
      saves a launch and a pass over the activation; off only to trace a numerics difference.
    - `batch=False`: a form's rows are one sequence's.
    - `pdl=auto`: on a GPU of compute capability 9.0 or later each kernel launches as a dependent of the one
      before it, so its launch and its blocks' start overlap that one's end (`triton/pdl.py`), except in a
      model whose dense products multiply a matrix in a grid format (the grid GEMV's), whose steps measured
      faster in the plain launch order (`kernels.dependent_launch_pays`). `on` and `off` force either; results
      are the same either way.
    - `norm_launch=True`: under int8 activations a down projection's residual add and norm take a launch of
      their own (`kernels.norm_in_own_launch`): the GEMV epilogue's serial tail costs more than a launch
      (measured in benchmarks/RESULTS.md). `off` keeps them in the GEMV's
      last program; a Q4_K_M layer whose V product takes its own launch (a Q6_K attn_v) then stays within
      the lane's budget of 7 launches without `rope_epilogue`.
    - `rope_epilogue=auto`: under int8 activations a decode step's query and key rotations (q/k norm, rope,
      the key's cache append) run in the QKV GEMV's epilogue (`triton/gemv/q8_rope.py`: the last program of
      each head turns it), a launch less a layer, only where the layer needs it to keep the lane's budget of
      7: under `norm_launch`, where the query and key are the GEMV's only parts (the V product, in another
      format, takes a launch of its own: a Q4_K_M layer's Q6_K attn_v). Elsewhere they keep a launch after
      the GEMV, which was never slower (benchmarks/RESULTS.md). `on` turns them in every layer
      whose tile divides a head, `off` in none; under either the V product in another format joins the
      GEMV as its second format (a step's GEMVs take two: the int8 GEMV, and under dequant the f32 GEMV by
      rows; `CudaShim._formats_mix`). Under `activations=dequant` the f32 GEMVs turn them alike
      (`triton/gemv/f32_rope.py`, a step's one row, heads of a multiple of 16 values): there a mixture's
      layer with its V apart takes its router's launch too, and would take 8 (not timed against the launch
      after the GEMV).
    - `weight_loads=as-written`: the int8 GEMVs read their weights on the read-only path, where ptxas sinks a
      prefetched chunk's loads to its sums (`triton/gemv/weight_loads.py`); `ahead` takes the coherent path,
      which the prefetch's barrier holds ahead. Results are the same either way; on the 7B `ahead` decoded
      0.7 % faster, within what a run varies, so the default is the old schedule.
    - `prefill=auto` (the default): `f16-scratch` for a sequence's prompt, so a model takes its file, its
      cache and a workspace of at most 5 % more (a 7B Q4_K_M: 26,378 tok/s at pp512 against the copies'
      31,106, at 4.95 GB against 18.0; benchmarks/RESULTS.md, 2026-12-03). The batch form (the server), whose
      every decode step of more sequences than the GEMV's rows multiplies as a chunk, takes `f16-copy` where
      the copies fit in the GPU's free memory beside the weights, the cache and a workspace, else
      `f16-scratch`; the lane decides when it loads (`run/lane.prefill_for`).
    - `prefill=f16-copy`: a chunk's products multiply f16 copies of the matrices with cuBLAS (made on first
      use; 3.6x a Q4_K matrix's bytes more memory), a row of the activation past 2^14 rounded to f16 under a
      power-of-two scale that the product's epilogue multiplies back (`triton/f16_scale.py`), so it does not
      overflow. Measured on the H200 (benchmarks/RESULTS.md, 2026-12-01), the int8 tensor-core
      GEMM from the checkpoint's bytes (`prefill=int8`: `triton/gemm_q8.py`, the formats of `gemm_tiles`;
      no copy, nothing rounded to f16) is still 6-20x slower than cuBLAS at its best tile (7B pp512 1,042
      against 23,639 tok/s), so it stays a knob until it is faster. `in-place` takes the f16 GEMMs that
      decode the weights in the kernel for every product (no copy): Q4_K and Q6_K a super-block a step with the
      sub-scales folded into the f16 weights (`triton/gemm_sb.py`, not yet timed), other formats `triton/gemm.py`
      (slower than the copies). `f16-scratch` keeps no copy either: each product decodes its matrix to f16
      (the copies' values) into one scratch (a layer's largest product, at most 64 MiB, less where a small
      model's workspace share does not hold it: `run/workspace`), a slab of rows at a time
      where it does not fit, and lets cuBLAS take it, one launch and the decode's traffic more a slab; a
      prompt then runs in 512-row chunks (`kernels.SCRATCH_CHUNK_ROWS`), so a 512-token prompt decodes each
      matrix once. Under either f16 knob a chunk's gated pair rounds its activation once and joins its two
      products in their epilogue (`f16_scale.gate_up_glu`): neither product is stored in f32.
    - `delta_products=tf32x3`: the chunked gated delta rule (`triton/gdn/chunked.py`) multiplies on the tensor
      cores in three TF32 products a step (about f32's rounding, as the chunk's routing product does; 255
      registers and 2.4 KB of stack a thread at Qwen3-Next's widths on sm_90). `ieee` takes f32 FMA products,
      the recurrence's numbers within f32 roundoff, which ptxas holds at 32 registers with 14.6 KB of stack:
      the spills made the 80B-A3B's pp512 895 tok/s against 2,091 for `tf32x3` (H200, benchmarks/RESULTS.md).
    - `round_in_place=auto`: under an f16 prefill a chunk's product rounds its f32 activation to f16 into a
      fresh buffer; where the activation dies there (no later op reads it: a down product's SwiGLU output, a
      gated pair's normed input) it may round it into the activation's own bytes instead, saving the copy (a
      512-row chunk's down: 9.2 MB on a 1.5B, 19.4 MB on a 7B) for a second read of each row (the rounding
      first finds the row's largest value, which it would otherwise overwrite). `auto` does so where that
      lets the workspace share (`run/workspace`) hold the scratch in fewer slabs than the copies do; `on`
      always, `off` never. The numbers are the same bits either way.
    - `chunk_rows=auto`: a session runs a prompt in chunks of the lane's rows (llama.cpp's ubatch): a
      mixture's 512 (`kernels.MOE_CHUNK_ROWS`); under `f16-scratch` 512 (`kernels.SCRATCH_CHUNK_ROWS`), or
      256 where the workspace share cannot hold a 512-row chunk's arena beside the scratch and can a
      256-row one's (`run/workspace.chunk_rows`: a small model in a low-bit mix, at about half the prompt's
      speed); else the session's. A number sets the rows (and sizes the workspace at them alone).
    - `shared_fold=on` (the default): a decode step's shared expert folds into the mixture's launches
      (SharedExpertFusion): its gate/up SwiGLU and, where it is gated (Qwen2-MoE's, not DeepSeek's), its
      gate's sigmoid on programs of their own in the kept experts' gate/up launch, its down rows in each
      program of the down launch, so a layer stays within the launch budget. `off` runs it in launches of its
      own (its gate/up GEMV, its down GEMV, and where gated its gate's score, the sigmoid and the row scale;
      the down launch adds the result). H200, Qwen3-Next-80B-A3B's
      replayed step: 3.67 ms folded (its SwiGLU as the kept experts' int8 tiles, `moe_kernels.MOE_SHARED_INT8`),
      3.90 folded in f32 products, 3.98 apart (benchmarks/RESULTS.md, 2026-12-03); folded into the down
      launch alone, where its programs made the rest wait, it took 5.02. H100, Q4_K_M, its down an int8
      product: DeepSeek-V2-Lite 2.146 folded, 2.239 apart; Qwen1.5-MoE-A2.7B, whose shared expert is as wide
      as its kept experts together, 1.813 folded, 1.761 apart (docs/moe.md).
    - `route_in_norm=off`: a decode step's routing keeps its own launch after the output projection's add + norm
      GEMV. `on` runs it in that launch (`route_in_norm`, `triton/moe/norm_route.py`: each program's share of
      the router's scores, summed by its group's and the launch's last programs, which norm and rank the row), a
      launch less a mixture layer (DeepSeek-V2-Lite 8 -> 7, Qwen3-30B-A3B 7 -> 6), measured slower: the one
      program's serial tail outlasts the routing launch it saves (H100, Q4_K_M tg128: V2-Lite 561.8 -> 543.3
      tok/s, Qwen3-30B-A3B 417.1 -> 393.4; benchmarks/RESULTS.md, 2026-12-07, fourth).
    - `latent_decode=packed`: under int8, a decode step's latent attention (heads of at most
      `attn_kernels.MLA_PACKED_MOST_HEADS`: V2-Lite's 16) takes the int8 numerics' f16 attention on the tensor cores,
      a row's heads the rows of one product (`triton/mla/packed.py`); V3's 128 heads, and every head under
      `dequant`, keep the CUDA cores' f32 products (`cores`, the knob's other value). H100, V2-Lite's heads:
      13.3 us at 4,096 rows against the cores' 66.5; the model's tg128 at depth 4,096 412 against 258 tok/s.
    """

    chip: Chip = H200
    activations: Activations = Activations.INT8
    cache_precision: CachePrecision = CachePrecision.F16
    recurrent_state: StatePrecision = StatePrecision.F32
    fuse_quant: bool = True
    batch: bool = False
    prefill_weights: PrefillWeights = PrefillWeights.AUTO
    dependent_launch: DependentLaunch = DependentLaunch.AUTO
    norm_launch: bool = True
    rope_epilogue: RopeEpilogue = RopeEpilogue.AUTO
    weight_loads: WeightLoads = WeightLoads.AS_WRITTEN
    delta_products: DeltaProducts = DeltaProducts.TF32X3
    shared_fold: bool = True
    round_in_place: RoundInPlace = RoundInPlace.AUTO
    latent_decode: LatentDecode = LatentDecode.PACKED
    route_in_norm: bool = False
    chunk_rows: int | None = None  # None: the lane's own (`auto`)

    @classmethod
    def parse(cls, settings: Iterable[str], base: CudaKnobs | None = None) -> CudaKnobs:
        """Knobs from `key=value` strings (`--knob activations=int8 --knob cache=f32`), over `base` or the
        defaults; a bad key or value is a one-line FuselaneError naming the choices."""
        knobs = base or cls()
        for setting in settings:
            key, sep, value = setting.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not key or not value:
                raise FuselaneError(f"a knob is key=value, not '{setting}' (knobs: {', '.join(_SETTERS)})")
            if key not in _SETTERS:
                raise FuselaneError(f"unknown knob '{key}' (knobs: {', '.join(_SETTERS)})")
            knobs = _SETTERS[key](knobs, value)
        return knobs


AUTO = "auto"  # a counted knob's value for the lane's own choice


def _choice(key: str, kind: type[enum.Enum], value: str) -> enum.Enum:
    try:
        return kind(value.lower())
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise FuselaneError(f"knob '{key}' takes one of {choices}, not '{value}'") from None


def _flag(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise FuselaneError(f"knob '{key}' takes on or off, not '{value}'")


def _dependent_launch(value: str) -> DependentLaunch:
    """`pdl`'s value: auto, or a flag (on / off and their spellings)."""
    if value.lower() == DependentLaunch.AUTO.value:
        return DependentLaunch.AUTO
    try:
        return DependentLaunch.ON if _flag("pdl", value) else DependentLaunch.OFF
    except FuselaneError:
        raise FuselaneError(f"knob 'pdl' takes auto, on or off, not '{value}'") from None


def _count(key: str, value: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise FuselaneError(f"knob '{key}' takes a positive whole number, not '{value}'")
    return int(value)


def _rows(key: str, value: str) -> int | None:
    """A count of rows, or None for `auto` (the lane's own)."""
    if value.lower() == AUTO:
        return None
    if not value.isdecimal() or int(value) <= 0:
        raise FuselaneError(f"knob '{key}' takes auto or a positive whole number, not '{value}'")
    return int(value)


def _chip(knobs: CudaKnobs, value: str) -> CudaKnobs:
    if value.lower() not in CHIPS:
        raise FuselaneError(f"knob 'chip' takes one of {', '.join(CHIPS)}, not '{value}'")
    return replace(knobs, chip=CHIPS[value.lower()])


_SETTERS = {
    "chip": _chip,
    "sms": lambda k, v: replace(k, chip=replace(k.chip, sms=_count("sms", v))),
    "smem": lambda k, v: replace(k, chip=replace(k.chip, smem_kib_per_block=_count("smem", v))),
    "activations": lambda k, v: replace(k, activations=_choice("activations", Activations, v)),
    "cache": lambda k, v: replace(k, cache_precision=_choice("cache", CachePrecision, v)),
    "state": lambda k, v: replace(k, recurrent_state=_choice("state", StatePrecision, v)),
    "fuse_quant": lambda k, v: replace(k, fuse_quant=_flag("fuse_quant", v)),
    "batch": lambda k, v: replace(k, batch=_flag("batch", v)),
    "prefill": lambda k, v: replace(k, prefill_weights=_choice("prefill", PrefillWeights, v)),
    "pdl": lambda k, v: replace(k, dependent_launch=_dependent_launch(v)),
    "norm_launch": lambda k, v: replace(k, norm_launch=_flag("norm_launch", v)),
    "rope_epilogue": lambda k, v: replace(k, rope_epilogue=_choice("rope_epilogue", RopeEpilogue, v)),
    "weight_loads": lambda k, v: replace(k, weight_loads=_choice("weight_loads", WeightLoads, v)),
    "delta_products": lambda k, v: replace(k, delta_products=_choice("delta_products", DeltaProducts, v)),
    "shared_fold": lambda k, v: replace(k, shared_fold=_flag("shared_fold", v)),
    "round_in_place": lambda k, v: replace(k, round_in_place=_choice("round_in_place", RoundInPlace, v)),
    "chunk_rows": lambda k, v: replace(k, chunk_rows=_rows("chunk_rows", v)),
    "latent_decode": lambda k, v: replace(k, latent_decode=_choice("latent_decode", LatentDecode, v)),
    "route_in_norm": lambda k, v: replace(k, route_in_norm=_flag("route_in_norm", v)),
}
