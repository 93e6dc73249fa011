"""Fused op classes: the names the optimizer gives its fusions and every lane answers for, and where each
stands.

A class names one fused op: a group of primitives a single launch can run. The list is fixed by what a lane
is asked (`supports`, see docs/design.md), so a lane's shim says for every class whether it runs it natively,
runs its parts apart, or refuses it, whether or not a rule builds it yet. `STANDING` records, for each class,
the rules that build it or what its rule waits for; `fuselane explain --classes` prints it beside the lanes'
answers, and a test holds it to the rule table.
"""

import enum
from dataclasses import dataclass


class ClassId(enum.Enum):
    """A fused op class; the value is the class's name as plans and explanations print it."""

    NORM_WEIGHT = "NormWeight"
    ADD_NORM = "AddNorm"
    NORM_THEN_ADD = "NormThenAdd"
    GATED_NORM = "GatedNorm"
    EMBED_SCALE = "EmbedScale"
    QK_NORM_ROPE = "QkNormRope"
    QK_NORM_ROPE_KV_APPEND = "QkNormRopeKvAppend"
    ROPE_KV_APPEND = "RopeKvAppend"
    ROPE_QK_ONE_LAUNCH = "RopeQkOneLaunch"
    MLA = "Mla"
    FLASH_DECODE = "FlashDecode"
    FLASH_PREFILL = "FlashPrefill"
    ATTENTION_VARIANTS_INLINE = "AttentionVariantsInline"
    ATTN_LSE_MERGE = "AttnLseMerge"
    GLU_ACT_MUL = "GluActMul"
    GEMV_GATE_UP_GLU = "GemvGateUpGlu"
    GEMM_BIAS = "GemmBias"
    MERGED_QKV = "MergedQkv"
    MERGED_GATE_UP = "MergedGateUp"
    GEMM_DEQUANT_INKERNEL = "GemmDequantInkernel"
    ROUTER_TOPK = "RouterTopk"
    MOE_TOKEN_SORT = "MoeTokenSort"
    MOE_GATE_UP_ACT = "MoeGateUpAct"
    MOE_DOWN_COMBINE = "MoeDownCombine"
    SHARED_EXPERT_FUSION = "SharedExpertFusion"
    GDN_STEP = "GdnStep"
    CONV_BIAS_SILU = "ConvBiasSilu"
    CONV_PARTS = "ConvParts"
    CONV_SILU_L2NORM = "ConvSiluL2norm"
    GDN_GATE_PROJECTIONS = "GdnGateProjections"
    GDN_GATING = "GdnGating"
    FUSED_SAMPLING = "FusedSampling"
    STRIDED_READ = "StridedRead"
    ROW_WRITE = "RowWrite"
    JOIN_IN_PLACE = "JoinInPlace"
    STRIDED_VALUES = "StridedValues"
    CUDA_GRAPHS = "CudaGraphs"
    NORM_QUANT = "NormQuant"
    ADD_NORM_QUANT = "AddNormQuant"
    GLU_ACT_MUL_QUANT = "GluActMulQuant"
    ELEMENTWISE_QUANT = "ElementwiseQuant"
    GDN_OUTPUT_QUANT = "GdnOutputQuant"
    GEMV_QUANT = "GemvQuant"
    GEMV_NORM_EPILOGUE = "GemvNormEpilogue"
    EMBED_NORM = "EmbedNorm"
    NORM_SCALE = "NormScale"
    NORM_WEIGHT_OFFSET = "NormWeightOffset"
    DUAL_NORM = "DualNorm"
    PREFILL_NORM_EPILOGUES = "PrefillNormEpilogues"
    ATTN_RESIDUAL_NORM = "AttnResidualNorm"
    QKV_HEAD_EPILOGUE = "QkvHeadEpilogue"
    RECOMPUTE_FANOUT = "RecomputeFanout"
    QK_NORM_ROPE_GATE_SPLIT = "QkNormRopeGateSplit"
    HORIZONTAL_NORM_ROPE_INSERT = "HorizontalNormRopeInsert"
    CROSS_LAYER_LAUNCH = "CrossLayerLaunch"
    ATTN_OUTPUT_QUANT = "AttnOutputQuant"
    ATTN_OUTPUT_GATE = "AttnOutputGate"
    ROW_WRITE_QUANT = "RowWriteQuant"
    MLA_PROLOGUE = "MlaPrologue"
    MLA_UNABSORB_IN_FOLD = "MlaUnabsorbInFold"
    ELEMENTWISE_CHAINS = "ElementwiseChains"
    ELEMENTWISE_REGIONS = "ElementwiseRegions"
    MASKED_EXPERT_ACTIVATION = "MaskedExpertActivation"
    GEMM_SCALE = "GemmScale"
    AFFINE_INPUT_FOLD = "AffineInputFold"
    ROUTER_SHARED_GATE_MERGE = "RouterSharedGateMerge"
    MOE_GATHER_IN_OPERAND = "MoeGatherInOperand"
    MOE_DEFERRED_FINALIZE = "MoeDeferredFinalize"
    GDN_INPUT_EPILOGUE = "GdnInputEpilogue"
    GDN_DECODE_WHOLE = "GdnDecodeWhole"
    GDN_POST_CONV_PREP = "GdnPostConvPrep"
    LAST_LAYER_ROWS = "LastLayerRows"
    RELU_SQR = "ReluSqr"
    SOFTCAP = "Softcap"
    MIXED_BATCH_ATTENTION = "MixedBatchAttention"
    SPARSE_ATTENTION = "SparseAttention"
    GROUPED_TOPK = "GroupedTopk"
    SAMPLING = "Sampling"
    KV_CACHE_QUANT = "KvCacheQuant"
    HADAMARD_ROTATION = "HadamardRotation"
    COMPENSATED_RESIDUAL = "CompensatedResidual"
    HOST_RESIDENT_KV = "HostResidentKv"
    ATTN_GQA_ROW_PACKING = "AttnGqaRowPacking"
    MOE_DIRECT_PAIRS = "MoeDirectPairs"
    PERSISTENT_LAYER_MEGAKERNEL = "PersistentLayerMegakernel"
    ALLREDUCE_NORM = "AllreduceNorm"


class Awaits(enum.Enum):
    """What a class no rule builds yet waits for: a model family, a form, a kind of rule, or nothing the graph
    can say (the value says which, as `explain --classes` prints it)."""

    GATED_DELTA_RULE = "rules regrouping a gated delta-rule layer's fused ops (qwen3next's run as they are)"
    GATED_ATTENTION = "gated attention (qwen3next's full-attention layers)"
    LATENT_ATTENTION = "rules over latent attention's value expansion and its values read in place (deepseek2)"
    ATTENTION_VARIANTS = "attention variants: soft caps, windows, sinks, sparse reads"
    OTHER_ARCHITECTURES = "an architecture with this shape (qwen2 / qwen3 graphs have none)"
    SCHEDULE_REWRITES = "rules that rewrite across the schedule (recompute, regroup across ops or layers)"
    MIXED_BATCHES = "a batch form mixing prefill chunks with decode rows"
    CACHE_NUMERICS = "numerics no lane keeps yet: quantized or rotated caches, compensated sums"
    IN_THE_LANE = "no graph rewrite: a lane does it inside its kernels or its runner, if at all"
    SEVERAL_GPUS = "several GPUs"


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a class stands: the rules (by name, as `--hold` takes them) that build it, or what it awaits."""

    built_by: tuple[str, ...] = ()
    awaits: Awaits | None = None

    def __post_init__(self) -> None:
        if bool(self.built_by) == (self.awaits is not None):
            raise ValueError("a class is either built by rules or awaits something, not both or neither")


def _built(*rules: str) -> Standing:
    return Standing(built_by=rules)


def _awaits(what: Awaits) -> Standing:
    return Standing(awaits=what)


_GDR = _awaits(Awaits.GATED_DELTA_RULE)
_MLA = _awaits(Awaits.LATENT_ATTENTION)
_ARCH = _awaits(Awaits.OTHER_ARCHITECTURES)
_SCHEDULE = _awaits(Awaits.SCHEDULE_REWRITES)
_LANE = _awaits(Awaits.IN_THE_LANE)

STANDING: dict[ClassId, Standing] = {
    ClassId.NORM_WEIGHT: _built("norm_weight"),
    ClassId.ADD_NORM: _built("add_norm"),
    ClassId.NORM_THEN_ADD: _built("norm_then_add"),
    ClassId.GATED_NORM: _built("gated_norm"),  # the delta rule's output normed and gated by silu(z)
    ClassId.EMBED_SCALE: _ARCH,  # an embedding scaled by a constant (Gemma)
    ClassId.QK_NORM_ROPE: _built("qk_norm_rope"),
    ClassId.QK_NORM_ROPE_KV_APPEND: _built("qk_norm_rope_kv_append"),
    ClassId.ROPE_KV_APPEND: _built("rope_kv_append"),
    ClassId.ROPE_QK_ONE_LAUNCH: _built("rope_q_k_one_launch", "rope_epilogue"),
    ClassId.MLA: _built("latent_expanded"),  # the cuda lane's rule: a wide chunk's latent attention expanded
    ClassId.FLASH_DECODE: _built("flash_decode"),
    ClassId.FLASH_PREFILL: _built("flash_prefill"),
    ClassId.ATTENTION_VARIANTS_INLINE: _awaits(Awaits.ATTENTION_VARIANTS),
    ClassId.ATTN_LSE_MERGE: _LANE,  # the decode attention merges its splits' partials itself
    ClassId.GLU_ACT_MUL: _built("glu_act_mul"),
    ClassId.GEMV_GATE_UP_GLU: _built("gate_up_glu"),
    ClassId.GEMM_BIAS: _built("gemm_bias"),
    ClassId.MERGED_QKV: _built("merged_projections", "gemv_parts"),
    ClassId.MERGED_GATE_UP: _built("merged_gate_up"),
    ClassId.GEMM_DEQUANT_INKERNEL: _LANE,  # a product by checkpoint rows dequantizes them in its kernel
    ClassId.ROUTER_TOPK: _built("router_topk", "route_in_norm"),
    ClassId.MOE_TOKEN_SORT: _built("moe_token_sort"),
    ClassId.MOE_GATE_UP_ACT: _built("moe_gate_up_act"),
    ClassId.MOE_DOWN_COMBINE: _built("moe_down_combine"),
    ClassId.SHARED_EXPERT_FUSION: _built("shared_expert_fusion"),
    ClassId.GDN_STEP: _built("gdn_step", "gates_in_step", "norm_in_step"),
    ClassId.CONV_BIAS_SILU: _built("conv_silu"),
    ClassId.CONV_PARTS: _built("conv_parts"),  # a step's convolutions feeding none of the others, one launch
    ClassId.CONV_SILU_L2NORM: _built("conv_silu_l2norm"),
    ClassId.GDN_GATE_PROJECTIONS: _built("gdn_gate_projections"),
    ClassId.GDN_GATING: _built("gdn_gating"),
    ClassId.FUSED_SAMPLING: _built("fused_sampling"),
    ClassId.STRIDED_READ: _built("strided_read"),
    ClassId.ROW_WRITE: _built("row_write"),
    ClassId.JOIN_IN_PLACE: _built("join_in_place", "join_row_write"),
    ClassId.STRIDED_VALUES: _MLA,  # an attention reading its values in place from the expanded latent
    ClassId.CUDA_GRAPHS: _LANE,  # the cuda lane's runner captures a step's launches and replays them
    ClassId.NORM_QUANT: _built("norm_quant"),
    ClassId.ADD_NORM_QUANT: _built("add_norm_quant"),
    ClassId.GLU_ACT_MUL_QUANT: _built("glu_quant"),
    ClassId.ELEMENTWISE_QUANT: _built("elementwise_quant"),
    ClassId.GDN_OUTPUT_QUANT: _built("gdn_output_quant"),
    ClassId.GEMV_QUANT: _built("gemv_quant"),
    ClassId.GEMV_NORM_EPILOGUE: _built("gemv_norm_epilogue"),
    ClassId.EMBED_NORM: _built("embed_norm"),
    ClassId.NORM_SCALE: _ARCH,
    ClassId.NORM_WEIGHT_OFFSET: _ARCH,  # a norm weight stored less one (Gemma)
    ClassId.DUAL_NORM: _ARCH,
    ClassId.PREFILL_NORM_EPILOGUES: _SCHEDULE,
    ClassId.ATTN_RESIDUAL_NORM: _ARCH,  # a norm of the attention's output before the residual add
    ClassId.QKV_HEAD_EPILOGUE: _built("qkv_head_epilogue"),
    ClassId.RECOMPUTE_FANOUT: _SCHEDULE,
    ClassId.QK_NORM_ROPE_GATE_SPLIT: _awaits(Awaits.GATED_ATTENTION),
    ClassId.HORIZONTAL_NORM_ROPE_INSERT: _SCHEDULE,
    ClassId.CROSS_LAYER_LAUNCH: _SCHEDULE,
    ClassId.ATTN_OUTPUT_QUANT: _built("attention_output_quant"),
    ClassId.ATTN_OUTPUT_GATE: _built("attn_output_gate"),
    ClassId.ROW_WRITE_QUANT: _built("row_write_quant"),
    ClassId.MLA_PROLOGUE: _built("mla_prologue"),  # the latent attention's two joins in place, one op
    ClassId.MLA_UNABSORB_IN_FOLD: _MLA,
    ClassId.ELEMENTWISE_CHAINS: _SCHEDULE,
    ClassId.ELEMENTWISE_REGIONS: _SCHEDULE,
    ClassId.MASKED_EXPERT_ACTIVATION: _LANE,  # every expert's activation under a mask of the kept: no lane does
    ClassId.GEMM_SCALE: _ARCH,
    ClassId.AFFINE_INPUT_FOLD: _ARCH,
    ClassId.ROUTER_SHARED_GATE_MERGE: _SCHEDULE,  # the router's and the shared gate's products as one
    ClassId.MOE_GATHER_IN_OPERAND: _LANE,  # an expert product gathers its rows as it reads its operand
    ClassId.MOE_DEFERRED_FINALIZE: _built("moe_deferred_finalize"),
    ClassId.GDN_INPUT_EPILOGUE: _GDR,
    ClassId.GDN_DECODE_WHOLE: _GDR,
    ClassId.GDN_POST_CONV_PREP: _GDR,
    ClassId.LAST_LAYER_ROWS: _SCHEDULE,  # the last layer computing only the rows the logits need
    ClassId.RELU_SQR: _ARCH,
    ClassId.SOFTCAP: _awaits(Awaits.ATTENTION_VARIANTS),
    ClassId.MIXED_BATCH_ATTENTION: _awaits(Awaits.MIXED_BATCHES),
    ClassId.SPARSE_ATTENTION: _awaits(Awaits.ATTENTION_VARIANTS),
    ClassId.GROUPED_TOPK: _built("grouped_topk"),
    ClassId.SAMPLING: _LANE,  # the cuda lane's decode loop samples on the device after the graph's logits
    ClassId.KV_CACHE_QUANT: _awaits(Awaits.CACHE_NUMERICS),
    ClassId.HADAMARD_ROTATION: _awaits(Awaits.CACHE_NUMERICS),
    ClassId.COMPENSATED_RESIDUAL: _awaits(Awaits.CACHE_NUMERICS),
    ClassId.HOST_RESIDENT_KV: _LANE,
    ClassId.ATTN_GQA_ROW_PACKING: _LANE,
    ClassId.MOE_DIRECT_PAIRS: _LANE,  # a chunk's pairs multiplied unsorted: the lane's choice, not a rewrite
    ClassId.PERSISTENT_LAYER_MEGAKERNEL: _LANE,
    ClassId.ALLREDUCE_NORM: _built("allreduce_norm"),  # a tensor-parallel rank's graph only
}
"""Every class's standing, in the class list's order."""


def built_by(cls: ClassId) -> tuple[str, ...]:
    """The rules that build `cls`; empty where none does yet."""
    return STANDING[cls].built_by
