"""The cuda lane's shim: its answer to the shared optimizer (the five questions of `fuse.shim.Shim`).

The shared rules decide a fusion by dataflow; the lane's kernels decide whether a fused op has a launch.
Every condition here (and in `fits`) is a fact about a kernel, read from `kernels`, the module the Triton
kernels size themselves by:

- a per-head product reads a part of every unit of its input in place only at whole 32-value blocks;
- an attention reads its values in place only from an even place at an even pitch, a pair at a time;
- a convolution's epilogue norms heads of at most 1024 values, whole warps, that divide its channels;
- a gated pair of products is one launch as GEMVs (a decode step's rows, a batch's, or the dequantized
  numerics), or on the tensor cores as one GEMM of the gate's and up's tiles side by side where their
  formats agree and the hidden width is whole pair tiles;
- a mixture folds its shared expert into a block of at most 32 warps of kept experts, and never writes its
  result at a row a parameter names;
- a product by checkpoint rows reads its activation quantized under the lane's quantized numerics (one int8
  word a value, or two), and a producer quantizes in its epilogue under `fuse_quant` where its kernel can;
- several products of one activation are one launch in parts: at most four, one format (two in a step's one
  row, int8 or f32), in the GEMV one number of rows a warp (the GEMM in parts on the tensor cores has no kernel yet).

A class is native only where the lane has the kernel that runs it in one launch (`launch.BINDERS`); the
specified classes it has no kernel for yet run as their parts (`classes.NO_KERNEL_CLASSES`). The lane's own rules
(`rules`) link in around the shared table: `gemv_parts` before `merged_projections`, and after the last
shared rule the settling passes that make the plan exactly what the lane launches. The lane rule
`latent_expanded` (before `add_norm`, `latent.py`) takes a wide chunk's latent attention whole as `Mla` where
its expanded launches fit, run as its three launches (`triton.mla.expand`, `triton.mla.expanded_attention`);
the absorbed form's launches (`triton.mla`) run every other latent attention (a decode step's, a batch's, a
narrow chunk's, and any under the dequantized numerics). The last settling pass, `chunked_delta` (`gdn.py`),
counts a chunk's delta step as the chunked form's two launches.

`held` names lane rules held back (`gemv_parts`) and the kernel choice `rows_a_warp` (every product a row
a warp), for ablation. The optimizer holds rules by its own `held` argument: build the shim with the same
names so its `fits` answers agree (a held `gemv_parts` is also skipped by the shim's pass itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from fuselane.fuse.rewriter import Rewriter
from fuselane.fuse.rules import SHARED_RULES
from fuselane.fuse.shim import DECOMPOSE, NATIVE, After, Before, LaneRule, Position, Support, refuse
from fuselane.fuse.views import GemvForm, class_of, gemv, leaves, moe, parts, rope
from fuselane.gguf.formats import Format
from fuselane.graph.classes import ClassId as C
from fuselane.graph.ir import Form, Op, QuantFormat, Rows, TensorGraph
from fuselane.graph.ops import Attention, ExpertMatmul, HeadMatmul, Moe
from fuselane.lanes.cuda.plan import attn_kernels, gdn, gemm_tiles, kernels, latent, moe_kernels
from fuselane.lanes.cuda.plan.classes import (
    DECOMPOSED_CLASSES,
    NATIVE_CLASSES,
    NO_KERNEL,
    NO_KERNEL_CLASSES,
    QUANT_EPILOGUES,
    REFUSED_CLASSES,
)
from fuselane.lanes.cuda.plan.fits import GEMV_PARTS, ROWS_A_WARP
from fuselane.lanes.cuda.plan.fits import fits as lane_fits
from fuselane.lanes.cuda.plan.knobs import (
    Activations,
    CachePrecision,
    CudaKnobs,
    DeltaProducts,
    DependentLaunch,
    PrefillWeights,
    RopeEpilogue,
    StatePrecision,
)
from fuselane.lanes.cuda.plan.rules import (
    PRODUCTS_APART,
    QUANTIZE_APART,
    ROPE_EPILOGUE,
    gemv_parts,
    products_apart,
    quantize_apart,
    rope_epilogue,
)
from fuselane.numerics.contract import (
    AttentionNumerics,
    Block,
    Bound,
    Contract,
    Keep,
    Kept,
    Quantized,
    Scale,
    Scheme,
)

# Consumers that read their operands as their first part reads them alone: a producer with its quantizing
# epilogue, and a projection with its epilogue folded in (which reads the projection's operands first).
_QUANTIZING = QUANT_EPILOGUES
_EPILOGUED = frozenset({C.GEMV_NORM_EPILOGUE, C.QKV_HEAD_EPILOGUE, C.MOE_DEFERRED_FINALIZE})

_ACTIVATION_FORMATS: dict[Activations, QuantFormat | None] = {
    Activations.DEQUANT: None,
    Activations.INT8: QuantFormat.ONE_WORD,
    Activations.INT8X2: QuantFormat.TWO_WORDS,
}
_IN_KERNEL = "decode the checkpoint's bytes to f16 in the kernel"  # the f16 GEMMs' words for `explain`
# why `auto` does not take the int8 tensor-core GEMM: H200 pp512, 7B Q4_K_M 2,220 against 26,915 tok/s, 0.5B
# 15,275 against 147,308, 1.5B 7,723 against 83,961 (benchmarks/RESULTS.md, 2026-12-02 and 2026-12-04)
_INT8_SLOWER = (
    "prefill=int8 multiplies on the int8 tensor cores from the checkpoint's bytes, rounding nothing to f16, "
    "at about a tenth of the speed (H200)"
)
# the chunked delta rule's products where they are not the default TF32x3 (`delta_products=ieee`)
IEEE_DELTA = "; the chunked delta rule multiplies in f32 FMA products (IEEE)"
_CACHE_KEEP = {CachePrecision.F32: Keep.F32, CachePrecision.F16: Keep.F16}
_STATE_KEEP = {StatePrecision.F32: Keep.F32, StatePrecision.BF16: Keep.BF16}

# Two-word attention: a weight times its value row's scale in three words.
_ATTENTION_WEIGHT_WORDS = 3


@dataclass(frozen=True, slots=True)
class CudaShim:
    """The cuda lane under its `knobs`, with the lane rules (and the `rows_a_warp` choice) in `held` held."""

    knobs: CudaKnobs = CudaKnobs()
    held: tuple[str, ...] = ()
    lane_holds = (ROWS_A_WARP,)  # kernel choices `--hold` takes besides rules: every product a row a warp

    @property
    def name(self) -> str:
        return f"cuda:{self.knobs.chip.name}:{self.knobs.activations.value}"

    # --- the protocol ------------------------------------------------------------------------------------

    def supports(self, cls: C) -> Support:
        """Native, decomposed, or refused with the reason a user sees, for every class."""
        if cls in NATIVE_CLASSES:
            return NATIVE
        if cls in QUANT_EPILOGUES:
            return NATIVE if self.knobs.fuse_quant else DECOMPOSE
        if cls in NO_KERNEL_CLASSES:
            return NO_KERNEL
        if cls in DECOMPOSED_CLASSES:
            return DECOMPOSE
        if cls is C.ATTN_GQA_ROW_PACKING and self.packs_gqa_rows:
            return NATIVE
        return refuse(REFUSED_CLASSES[cls])

    @property
    def packs_gqa_rows(self) -> bool:
        """Whether a decode step's attention takes a key/value group's query heads as the rows of f16
        tensor-core products (`triton/attention/group_decode.py`): under the numerics whose attention takes f16
        operands (the int8 ones); under the others its heads' dots run on the CUDA cores, as the specification's
        lane does."""
        numerics = self.attention(self.knobs.activations)
        return numerics is not None and numerics.queries == Kept(Keep.F16)

    def fits(self, op: Op, g: TensorGraph) -> str | None:
        """Why the lane's kernels have no launch for `op`, or None when one does (see `fits`)."""
        return lane_fits(self, op, g)

    def activation(self, consumer: Op, operand: int, g: TensorGraph) -> QuantFormat | None:
        """The quantized form in which `consumer` reads its operand `operand`: the lane's activation format
        for the activation of a product by checkpoint rows the int8 GEMV takes (`kernels.int8_gemv`: a decode
        step's one row or a batch's rows, its formats), alone, as a gated pair or in parts, and of a decode
        step's mixture; and of a chunk's product the int8 GEMM takes (`int8_gemm`). Other products (a batch's
        in other formats or of its mixtures, a chunk's in other formats or within the GEMV's rows) read the
        f32 activation, so nothing quantizes it for them."""
        cls = class_of(consumer)
        if cls in _QUANTIZING:
            return self.activation(parts(consumer)[0], operand, g)
        if cls in _EPILOGUED or (cls is C.ROUTER_TOPK and class_of(parts(consumer)[0]) is not None):
            # an epilogue's, or a routing that took in the norm it reads (`route_in_norm`): its first part's
            first = parts(consumer)[0]
            return self.activation(first, operand, g) if operand < len(first.ins) else None
        fmt = self.activation_format
        if fmt is None or operand != 0:
            return None
        first = parts(consumer)[0] if cls in (C.GEMV_GATE_UP_GLU, C.MERGED_QKV) else consumer
        if self.knobs.batch and g.rows != 1:  # a batch's products on the int8 GEMV over its rows; its mixtures f32
            p = self.part_product(first, g)
            return fmt if moe(consumer) is None and p is not None and self.int8_gemv(p, batch=True) else None
        if g.rows != 1:  # a chunk's products past the GEMV's rows on the int8 tensor cores; the rest read f32
            p = self.part_product(first, g)
            return fmt if p is not None and self.int8_gemm(p) else None
        if moe(consumer) is not None:
            return fmt if self._experts_read_int8(consumer, consumer.ins[operand], g) else None
        p = self.part_product(first, g)
        return fmt if p is not None and self.int8_gemv(p) else None

    @staticmethod
    def int8_gemv(p: GemvForm, batch: bool = False) -> bool:
        """Whether a product by checkpoint rows reads its activation in int8: one the int8 GEMV multiplies (over a
        batch's rows where `batch`), or a step's one row in a grid format the grid GEMV meets in dp4a
        (`kernels.grid_int8`)."""
        if not isinstance(p.weights, Rows):
            return False
        fmt = p.weights.format
        return kernels.int8_gemv(fmt, p.m, p.k, batch) or kernels.grid_int8(fmt, p.m, batch)

    def int8_gemm(self, p: GemvForm) -> bool:
        """Whether a chunk's product multiplies on the int8 tensor cores (`gemm_tiles.int8_gemm`): past the
        GEMV's rows, under int8 activations and `prefill=int8`, by checkpoint rows in one of its formats. Not a
        batch's: its rows past the GEMV's take the f16 tensor cores whatever the `prefill` knob (the int8 GEMM
        is the slower by far, kept for a chunk's memory)."""
        return (
            not self.knobs.batch
            and self.on_tensor_cores(p)
            and self.knobs.prefill_weights is PrefillWeights.INT8
            and gemm_tiles.int8_gemm(p.weights.format, p.m, p.k)  # type: ignore[union-attr]
        )

    def quantizes_in_epilogue(self, producer: Op, g: TensorGraph) -> bool:
        """Whether `producer` writes its result's int8 form in its own kernel's epilogue: an add + norm; SwiGLU's
        product of rows of whole 32-value blocks; a decode step's projection whose last program norms its row,
        and gated pair (a batch's only at one row), where they read their own activation in int8 and write
        whole 32-value blocks; the decode attention (a batch's too), and a chunk's of heads of whole 32-value
        blocks; the gated norm, and a per-head product (DeepSeek's value half), of heads of whole 32-value
        blocks."""
        cls = class_of(producer)
        if cls is C.ADD_NORM or cls is C.FLASH_DECODE:
            return True
        if cls is C.GLU_ACT_MUL:  # its launch quantizes rows of whole 32-value blocks
            return g.tensors[producer.out].shape[-1] % kernels.QBLOCK == 0
        if isinstance(producer.sym, Attention) or cls in (C.FLASH_PREFILL, C.ATTN_OUTPUT_GATE):
            spec = leaves(producer)[0].sym  # the attention: a chunk's quantizes heads of whole 32-value blocks
            return spec.rows == 1 or spec.hd % kernels.QBLOCK == 0  # type: ignore[union-attr]
        if cls is C.GATED_NORM:  # a program a head: heads of whole 32-value blocks quantize in its store
            return gdn.gated_norm_quantizes(producer)
        if isinstance(producer.sym, HeadMatmul):  # a program a block of a head's outputs
            return attn_kernels.head_product_quantizes(producer.sym.b)
        if cls is C.GEMV_NORM_EPILOGUE and self._grid_product(producer, g):
            # the grid GEMV's add + norm: its last program writes the normed row's int8 form, whole blocks
            return g.tensors[producer.out].shape[-1] % kernels.QBLOCK == 0
        if cls in (C.GEMV_NORM_EPILOGUE, C.GEMV_GATE_UP_GLU):
            # the one-row int8 GEMV's epilogues; a batch's rows past one are quantized by a launch of their own
            p = gemv(parts(producer)[0], g)
            rows = kernels.GEMV_ROWS if not self.knobs.batch else 1
            within = p is not None and p.m <= rows and p.n % kernels.QBLOCK == 0
            return within and self.activation(producer, 0, g) is not None
        if cls is C.MOE_GATE_UP_ACT:
            return self._experts_in_int8(producer, g)
        if cls is C.MOE_DEFERRED_FINALIZE:
            m = moe(producer)
            return m is not None and m.rows == 1 and m.d % kernels.QBLOCK == 0
        return False

    @staticmethod
    def _grid_product(op: Op, g: TensorGraph) -> bool:
        """Whether a fused op's first part is a product of a step's one row in a grid format."""
        p = gemv(parts(op)[0], g)
        grid = p is not None and isinstance(p.weights, Rows) and p.weights.format in kernels.GRID_GEMV_FORMATS
        return grid and p.m == 1

    @staticmethod
    def _experts_read_int8(op: Op, x: str, g: TensorGraph) -> bool:
        """Whether the kept experts' products of `op` that read `x` are ones the int8 GEMV multiplies (its
        formats, whole blocks), or a step's in a grid format (`grid.experts`): only then is `x` quantized for
        them."""
        products = [p for p in leaves(op) if isinstance(p.sym, ExpertMatmul) and p.ins[0] == x]
        for p in products:
            storage = g.tensors[p.ins[1]].storage
            spec: ExpertMatmul = p.sym  # type: ignore[assignment]
            if not isinstance(storage, Rows):
                return False
            fmt = storage.format
            if not (kernels.int8_gemv(fmt, 1, spec.kd) or kernels.grid_int8(fmt, spec.rows)):
                return False
        return bool(products)

    def _experts_in_int8(self, op: Op, g: TensorGraph) -> bool:
        """Whether the kept experts' gate/up products of a decode step read their activation in int8 (the int8
        GEMV's formats, whole blocks), so their kernel writes its result's int8 form: a tile is one block."""
        product = next((x for x in leaves(op) if isinstance(x.sym, ExpertMatmul)), None)
        storage = g.tensors[product.ins[1]].storage if product is not None else None
        if product is None or not isinstance(storage, Rows) or self.activation(op, 0, g) is None:
            return False
        spec: ExpertMatmul = product.sym  # type: ignore[assignment]
        int8 = kernels.int8_gemv(storage.format, spec.rows, spec.kd) or kernels.grid_int8(storage.format, spec.rows)
        return int8 and spec.n % kernels.QBLOCK == 0

    def rules(self) -> list[tuple[Position, LaneRule]]:
        """The lane's own rules and where they link into the shared table (`rules`): the GEMV in parts before
        `merged_projections`; the settling passes, which `--hold` does not take, after the last shared rule."""
        last = SHARED_RULES[-1].name
        return [
            (Before("add_norm"), LaneRule(latent.RULE, (C.MLA,), partial(latent.latent_expanded, self))),
            (Before("merged_projections"), LaneRule(GEMV_PARTS, (C.MERGED_QKV,), self.gemv_parts)),
            (
                After(last),
                LaneRule(ROPE_EPILOGUE, (C.ROPE_QK_ONE_LAUNCH,), partial(rope_epilogue, self), holdable=False),
            ),
            (After(ROPE_EPILOGUE), LaneRule(PRODUCTS_APART, (), partial(products_apart, self), holdable=False)),
            (After(PRODUCTS_APART), LaneRule(QUANTIZE_APART, (), partial(quantize_apart, self), holdable=False)),
            (After(QUANTIZE_APART), LaneRule(gdn.CHUNKED_DELTA, (), gdn.chunked_delta, holdable=False)),
        ]

    def numerics(self) -> Contract:
        """The lane's numerics contract at its knobs."""
        k = self.knobs
        return Contract(
            point=(
                f"the cuda lane: {k.activations.value} activations, {k.cache_precision.value} cache, "
                f"{k.recurrent_state.value} state; a chunk's products {self.prefill_products}"
                + (f"; a batch's products {self.batch_products}" if k.batch else "")
                + (IEEE_DELTA if k.delta_products is DeltaProducts.IEEE else "")
            ),
            activations=self.scheme,
            cache=_CACHE_KEEP[k.cache_precision],
            state=_STATE_KEEP[k.recurrent_state],
            attention=self.attention(k.activations),
            fused=Bound.EXACT,  # type: ignore[attr-defined]
            accumulator_bits=self.accumulator_bits,
        )

    def dependent_launches(self, formats: Iterable[Format]) -> bool:
        """Whether each launch is made a dependent of the one before it (`pdl`), for a model whose matrices
        are in `formats`: under `auto`, where that pays (`kernels.dependent_launch_pays`)."""
        setting = self.knobs.dependent_launch
        if setting is DependentLaunch.AUTO:
            return kernels.dependent_launch_pays(formats)
        return setting is DependentLaunch.ON

    # --- numerics --------------------------------------------------------------------------------------

    @property
    def prefill_products(self) -> str:
        """How a chunk's products past the GEMV's rows multiply, under the `prefill` knob (what `explain`
        prints): the int8 tensor cores, the f16 ones decoding the weights in the kernel, or f16 copies."""
        k = self.knobs
        if k.prefill_weights is PrefillWeights.INT8 and k.activations is Activations.INT8:
            formats = ", ".join(sorted(f.name for f in gemm_tiles.INT8_GEMM_FORMATS))
            return f"run on the int8 tensor cores from the checkpoint's bytes in {formats}; other formats {_IN_KERNEL}"
        return self._f16_products

    @property
    def _f16_products(self) -> str:
        """How products past the GEMV's rows multiply on the f16 tensor cores, under the `prefill` knob."""
        scaled = "each activation row past 2^14 under a power-of-two scale"
        if self.knobs.prefill_weights is PrefillWeights.F16_COPY:
            return f"multiply f16 copies of the matrices, {scaled} (prefill=f16-copy)"
        decoded = "decode each matrix to f16 into one scratch just before cuBLAS multiplies it, no copy kept"
        if self.knobs.prefill_weights is PrefillWeights.F16_SCRATCH:
            return f"{decoded}, {scaled} (prefill=f16-scratch)"
        if self.knobs.prefill_weights is PrefillWeights.AUTO and self.knobs.batch:
            copies = "multiply f16 copies of the matrices where they fit in the GPU's free memory, else"
            return f"{copies} {decoded}, {scaled} (prefill=auto)"
        if self.knobs.prefill_weights is PrefillWeights.AUTO:
            faster = "prefill=f16-copy keeps f16 copies instead: faster, at 3.6x a Q4_K matrix's bytes"
            return f"{decoded}, {scaled} (prefill=auto; {faster}; {_INT8_SLOWER})"
        return _IN_KERNEL

    @property
    def batch_products(self) -> str:
        """How a batch's products multiply under the `batch` knob (what `explain` prints): up to the GEMV's rows,
        the int8 GEMV over the batch's rows in its formats, the f32 GEMV in the others and for a mixture's
        experts; past them, as a chunk's (its f16 products, whatever the `prefill` knob)."""
        gemv = (
            "read f32 rows"
            if self.knobs.activations is Activations.DEQUANT
            else ("read int8 rows in the int8 GEMV's formats, f32 rows in other formats and a mixture's kept experts")
        )
        return f"up to {kernels.GEMV_ROWS} rows {gemv}; past them {self._f16_products}"

    @property
    def activation_format(self) -> QuantFormat | None:
        """The quantized form products read their activation in; None under the dequantized numerics."""
        return _ACTIVATION_FORMATS[self.knobs.activations]

    @property
    def scheme(self) -> Scheme | None:
        fmt = self.activation_format
        return None if fmt is None else Scheme.of(fmt)

    @property
    def accumulator_bits(self) -> int:
        return kernels.accumulator(kernels.mode(self.knobs.activations)).bits

    @staticmethod
    def attention(activations: Activations) -> AttentionNumerics | None:
        """How a wide chunk's attention takes its operands: on the f16 tensor cores under one word (queries,
        keys, values and weights rounded to f16; a decode step's too, its groups' heads packed:
        `packs_gqa_rows`); on the int8 tensor cores under two (each query, key and
        value row in two words under its largest over 127, each weight times its value row's scale in three
        under the largest of its row in the tile); in f32 under the dequantized numerics."""
        if activations is Activations.DEQUANT:
            return None
        if activations is Activations.INT8:
            f16 = Kept(Keep.F16)
            return AttentionNumerics(queries=f16, keys_values=f16, weights=f16)

        def row(words: int) -> Quantized:
            return Quantized(Scheme(Block.ROW, Scale.MAX_OVER_127, words))

        return AttentionNumerics(queries=row(2), keys_values=row(2), weights=row(_ATTENTION_WEIGHT_WORDS))

    # --- products ----------------------------------------------------------------------------------------

    def per_warp(self, p: GemvForm) -> int:
        """The output rows a warp of a product's kernel takes: four for a wide product in a block format met
        one row at a time (`kernels.rows_a_warp`), one otherwise."""
        if isinstance(p.weights, Rows) and ROWS_A_WARP not in self.held:
            return kernels.rows_a_warp(p.weights.format, p.n, p.k, p.m)
        return 1

    def on_tensor_cores(self, p: GemvForm) -> bool:
        """Whether a product multiplies on the int8 tensor cores: past the GEMV's rows (a chunk's or a
        batch's), under the quantized numerics, by checkpoint rows."""
        return (
            p.m > kernels.GEMV_ROWS
            and self.knobs.activations is not Activations.DEQUANT
            and isinstance(p.weights, Rows)
        )

    @staticmethod
    def lands_whole(p: GemvForm) -> bool:
        """Whether a product lands where a launch in parts writes it: a buffer of its own, or a table's rows
        its width wide."""
        return p.dst.unit is None and (p.dst.row is None or p.dst.row.pitch == p.n)

    @staticmethod
    def rows_product(op: Op, g: TensorGraph) -> GemvForm | None:
        """An op's product, where it is a plain product by checkpoint rows (not one quantizing its output)."""
        p = gemv(op, g)
        return p if p is not None and isinstance(p.weights, Rows) else None

    @staticmethod
    def part_product(op: Op, g: TensorGraph) -> GemvForm | None:
        """The product a member of a GEMV in parts computes: a plain product by checkpoint rows, or one that
        turns its heads in its epilogue."""
        if class_of(op) is C.QKV_HEAD_EPILOGUE:
            return CudaShim.rows_product(parts(op)[0], g)
        return CudaShim.rows_product(op, g)

    @staticmethod
    def turned_alike(members: Sequence[Op]) -> bool:
        """Whether the members of a GEMV in parts that turn their heads in its epilogue turn them as one
        launch of rotations would: at most a query's and a key's, by one table at one position, one head
        width, both normed or neither.

        The rotation computes its cos/sin from the frequency base at the position, so "one table" is one
        (base, pos)."""
        sides = [
            side for m in members if class_of(m) is C.QKV_HEAD_EPILOGUE and (side := rope(parts(m)[1])) is not None
        ]
        if len(sides) > attn_kernels.ROPE_SIDES:
            return False
        keys = {(s.base, s.pos, s.hd, s.half, s.norm is not None) for s in sides}
        return len(keys) <= 1

    def gemv_mergeable(self, p: GemvForm) -> bool:
        """Whether a product is one the GEMV takes in parts: within the GEMV's rows, landing whole, its
        outputs whole warps of rows, its rows whole 32-value blocks (only a float matrix is ragged); in a grid
        format a step's one row (`grid.gemv.gemv_grid_parts`)."""
        grid = isinstance(p.weights, Rows) and p.weights.format in kernels.GRID_GEMV_FORMATS
        return (
            (not grid or p.m == 1)
            and p.m <= kernels.GEMV_ROWS
            and self.lands_whole(p)
            and p.n % self.per_warp(p) == 0
            and p.k % kernels.QBLOCK == 0
        )

    def gemv_takes(self, p: GemvForm, g: TensorGraph) -> bool:
        """Whether a GEMV multiplies a product of at most the GEMV's rows: the f32 GEMVs by checkpoint rows in
        their formats (`kernels.rows_gemv`: Q2_K, Q3_K, IQ4_NL and IQ4_XS at a step's one row only) and the grid
        GEMV in the grid formats, the int8 GEMV in the others where the plan quantizes the activation for it (a
        step's one row, a batch's rows). A chunk of a few rows in those four formats multiplies as a longer
        chunk does, on cuBLAS."""
        if not isinstance(p.weights, Rows) or kernels.rows_gemv(p.weights.format, p.m):
            return True
        if p.weights.format in kernels.GRID_GEMV_FORMATS:
            return True
        return self.reads_int8(p, g)

    def reads_int8(self, p: GemvForm, g: TensorGraph) -> bool:
        """Whether a product within the GEMV's rows runs on the int8 GEMV, reading its activation's int8 form:
        a step's one row or a batch's rows, in the int8 GEMV's formats, under int8 activations."""
        batch = self.knobs.batch and g.rows != 1
        return self.activation_format is not None and (g.rows == 1 or batch) and self.int8_gemv(p, batch=batch)

    def gemv_in_parts(self, members: Sequence[Op], g: TensorGraph) -> bool:
        """Whether every member of a GEMV in parts is one the GEMV takes together: at most four, one
        activation, one format (two in a step's one-row GEMVs: `_formats_mix`). Any widths: the int8 GEMV's and
        the fast GEMV's tiles are their format's, and the GEMV by rows takes its narrowest part's tile (one row
        a warp where any part's is), so a wide query and a narrow key and value share a launch."""
        products = [self.part_product(m, g) for m in members]
        if not products or any(p is None for p in products):
            return False
        first = products[0]
        assert first is not None
        return (
            len(products) <= kernels.GEMM_PARTS
            and self.turned_alike(members)
            and all(
                self.gemv_mergeable(p) and self.gemv_takes(p, g) and (p.x, p.k, p.m) == (first.x, first.k, first.m)
                for p in products
                if p is not None
            )
            and self._formats_mix(members, products, g)  # type: ignore[arg-type]
        )

    def _formats_mix(self, members: Sequence[Op], products: Sequence[GemvForm], g: TensorGraph) -> bool:
        """Whether a GEMV in parts takes its members' weights: one storage, or a step's one row's rows of
        `kernels.GEMV_PARTS_FORMATS` formats (Q4_K_M's Q6_K attn_v or Qwen3-Next attn_qkv) in the int8 GEMV, or
        in the f32 GEMV by rows where none reads int8 (`activations=dequant`), except where the second would
        cost the query and key their turn in the epilogue (`rope_epilogue=auto`)."""
        first = products[0].weights
        if all(p.weights == first for p in products):
            return True
        if not all(isinstance(p.weights, Rows) and p.m == 1 for p in products):
            return False
        if any(p.weights.format in kernels.GRID_GEMV_FORMATS for p in products):  # type: ignore[union-attr]
            return False  # the grid GEMV in parts takes one grid format
        int8 = [self.reads_int8(p, g) for p in products]
        f32 = not any(int8) and all(kernels.rows_gemv(p.weights.format, 1) for p in products)  # type: ignore[union-attr]
        if not (all(int8) or f32):
            return False
        if len({p.weights for p in products}) > kernels.GEMV_PARTS_FORMATS:
            return False
        knobs = self.knobs
        if knobs.rope_epilogue is not RopeEpilogue.AUTO or not knobs.norm_launch:
            return True
        turns = [class_of(m) is C.QKV_HEAD_EPILOGUE for m in members]
        alike = [t for t, p in zip(turns, products, strict=True) if p.weights == first]
        return not any(turns) or not all(alike)

    def pairs_on_cublas(self, g: TensorGraph) -> bool:
        """Whether a prefill chunk's gated pair runs whole on cuBLAS (the `prefill` knob's f16 copies or
        scratch): the activation rounded once, the GLU in the products' epilogue."""
        return g.form is Form.PREFILL and self.knobs.prefill_weights.cublas

    def gemm_parts(self, members: Sequence[Op], g: TensorGraph) -> bool:
        """Whether every member of a GEMM in parts is one the tensor cores take together: at most four, one
        activation, one format, each whole 128-output tiles."""
        products = [self.rows_product(m, g) for m in members]
        if not products or any(p is None for p in products):
            return False
        first = products[0]
        assert first is not None
        return len(products) <= kernels.GEMM_PARTS and all(
            self.on_tensor_cores(p)
            and self.lands_whole(p)
            and p.n % kernels.GEMM_TILE_N == 0
            and p.weights == first.weights
            and (p.x, p.k, p.m) == (first.x, first.k, first.m)
            for p in products
            if p is not None
        )

    @staticmethod
    def moe_down_launch(op: Op, g: TensorGraph) -> tuple[int, int] | None:
        """A decode mixture's down projection launch (`moe_kernels.moe_down_launch`): its experts' intermediate
        width from the mixture's own spec, its shared expert's from that expert's down projection (the fold's
        product that lands the model's width) where it is folded in; None where the parts do not say."""
        m = moe(op)
        dff = next((leaf.sym.dff for leaf in leaves(op) if isinstance(leaf.sym, Moe)), None)
        if m is None or dff is None:
            return None
        sdff = 0
        if class_of(op) is C.SHARED_EXPERT_FUSION:
            landing = [p for x in leaves(op) if (p := gemv(x, g)) is not None and p.n == m.d]
            if not landing:
                return None
            sdff = landing[0].k
        return moe_kernels.moe_down_launch(m.d, dff, m.k, sdff)

    # --- the lane rule ---------------------------------------------------------------------------------

    def gemv_parts(self, r: Rewriter) -> None:
        """The lane rule `gemv_parts` (`rules.gemv_parts`)."""
        gemv_parts(self, r)


def chunks_apart(splits: int, rows: int, head_blocks: int, sms: int) -> bool:
    """Whether an attention cut into `splits` chunks runs a block a chunk: where its rows' head blocks alone
    leave the chip idle (fewer than `ATTN_WAVES` blocks a SM)."""
    return splits > 1 and rows * head_blocks < attn_kernels.ATTN_WAVES * sms
