"""The quantization mixes `synth` writes, in llama.cpp's recipes: a mix's matrix formats by kind and layer
(`llama_tensor_get_type` in src/llama-quant.cpp, for a source in f16/bf16 without an importance matrix), its
`general.file_type`, and the fallback format where a row is not whole blocks of the chosen one. `synth` applies
them to a shape's tensors (`synth.tensor_formats`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from gguf import LlamaFileType

from fuselane.errors import FuselaneError
from fuselane.gguf.formats import GRID_FORMATS, LAYOUTS, Format


class Mix(enum.Enum):
    """Quantization mixes of the matrices (1-D norms and biases are always F32): llama-quantize's file types,
    each in llama.cpp's recipe (`RECIPES`)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q6_K = "q6_k"
    Q5_K_M = "q5_k_m"
    Q4_K_M = "q4_k_m"
    Q4_K_M_05B = "q4_k_m_05b"  # the real Qwen2.5-0.5B Q4_K_M file's mix (see `layer_ranks`)
    Q5_0 = "q5_0"
    Q4_0 = "q4_0"
    IQ4_XS = "iq4_xs"
    Q3_K_M = "q3_k_m"
    Q2_K = "q2_k"
    MXFP4_MOE = "mxfp4_moe"  # 3-D matrices (a mixture's experts) MXFP4, every other matrix Q8_0
    IQ3_M = "iq3_m"
    IQ3_XXS = "iq3_xxs"  # as made with an importance matrix (its q and k IQ2_S need one)
    IQ2_M = "iq2_m"  # as made with an importance matrix

    @classmethod
    def parse(cls, mix: Mix | str) -> Mix:
        """A Mix from itself or its name ('q4_k_m', 'Q4_K_M'); FuselaneError for an unknown one."""
        if isinstance(mix, Mix):
            return mix
        try:
            return cls(mix.lower())
        except ValueError:
            raise FuselaneError(f"unknown mix '{mix}': choose one of {', '.join(m.value for m in cls)}") from None


# The mixes whose projections are mostly in the grid formats: the cuda lane takes a step's grid products apart
# from the GEMV in parts and from the int8 epilogues (`fits._grid_launch`), so their layers take more launches than
# the budget (`tests/lanes/test_launch_budget.py` holds them to their own count).
GRID_MIXES = frozenset({Mix.IQ3_M, Mix.IQ3_XXS, Mix.IQ2_M})

FILE_TYPES: dict[Mix, LlamaFileType] = {
    Mix.F32: LlamaFileType.ALL_F32,
    Mix.F16: LlamaFileType.MOSTLY_F16,
    Mix.BF16: LlamaFileType.MOSTLY_BF16,
    Mix.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Mix.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    Mix.Q5_K_M: LlamaFileType.MOSTLY_Q5_K_M,
    Mix.Q4_K_M: LlamaFileType.MOSTLY_Q4_K_M,
    Mix.Q4_K_M_05B: LlamaFileType.MOSTLY_Q4_K_M,
    Mix.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Mix.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Mix.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    Mix.Q3_K_M: LlamaFileType.MOSTLY_Q3_K_M,
    Mix.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    Mix.MXFP4_MOE: LlamaFileType.MOSTLY_MXFP4_MOE,
    Mix.IQ3_M: LlamaFileType.MOSTLY_IQ3_M,
    Mix.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    Mix.IQ2_M: LlamaFileType.MOSTLY_IQ2_M,
}

# general.file_type of a file of given weights, by its most used matrix format
FORMAT_FILE_TYPES: dict[Format, LlamaFileType] = {
    Format.F32: LlamaFileType.ALL_F32,
    Format.F16: LlamaFileType.MOSTLY_F16,
    Format.BF16: LlamaFileType.MOSTLY_BF16,
    Format.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    Format.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    Format.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    Format.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    Format.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    Format.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    Format.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    Format.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    Format.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    Format.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    Format.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    Format.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    Format.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    Format.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    Format.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    Format.IQ2_S: LlamaFileType.MOSTLY_IQ2_S,
    Format.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    Format.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
    Format.IQ1_S: LlamaFileType.MOSTLY_IQ1_S,
    Format.IQ1_M: LlamaFileType.MOSTLY_IQ1_M,
    Format.TQ1_0: LlamaFileType.MOSTLY_TQ1_0,
    Format.TQ2_0: LlamaFileType.MOSTLY_TQ2_0,
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits` (llama-quant.cpp): the layers whose attn_v and ffn_down get Q6_K in Q4_K_M.

    The first and last eighth, and every third layer between them, in C integer arithmetic:
    `i < n/8 || i >= 7*n/8 || (i - n/8) % 3 == 2`.
    """
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_ranks(n_layers: int, mix: Mix) -> list[int]:
    """The index llama-quantize counted each layer as when it applied `use_more_bits`.

    llama-quantize counts attn_v / ffn_down tensors in the order the source file holds them. For Q4_K_M that
    is taken as layer order. The real Qwen2.5-0.5B file was converted with tensors sorted by name, so its
    layers were counted in string order (0, 1, 10, 11, ..., 19, 2, 20, ...): its Q6_K ffn_down / Q8_0 attn_v
    layers are 0, 1, 3, 6-10, 13, 16, 19, 21 rather than 0-2, 5, 8, ..., 20-23; Q4_K_M_05B reproduces that.
    """
    if mix is not Mix.Q4_K_M_05B:
        return list(range(n_layers))
    counted = sorted(range(n_layers), key=str)
    return [counted.index(i) for i in range(n_layers)]


# llama.cpp's fallback when a tensor's rows are not whole blocks of the chosen format (llama-quant.cpp,
# convert_incompatible_tensor); F16 when the fallback does not fit either.
FALLBACK: dict[Format, Format] = {
    **dict.fromkeys(GRID_FORMATS - {Format.TQ1_0, Format.TQ2_0}, Format.IQ4_NL),
    Format.TQ1_0: Format.Q4_0,
    Format.TQ2_0: Format.Q4_0,
    Format.Q2_K: Format.IQ4_NL,
    Format.Q3_K: Format.IQ4_NL,
    Format.IQ4_XS: Format.IQ4_NL,
    Format.Q4_K: Format.Q5_0,
    Format.Q5_K: Format.Q5_1,
    Format.Q6_K: Format.Q8_0,
}


def fit_format(fmt: Format, row: int) -> Format:
    """`fmt`, or llama.cpp's fallback for it when a row of `row` values is not whole blocks of `fmt`."""
    if row % LAYOUTS[fmt].values == 0:
        return fmt
    fmt = FALLBACK.get(fmt, Format.F16)
    return fmt if row % LAYOUTS[fmt].values == 0 else Format.F16


@dataclass(frozen=True, slots=True)
class Recipe:
    """A mix's choice of format per matrix, as llama.cpp's `llama_tensor_get_type` makes it for a dense model
    (src/llama-quant.cpp): `base` for every matrix it does not name; the output projection (the embedding
    table when tied) `output` (Q6_K) unless `base` is Q8_0 or unquantized; the embedding table `token_embd`
    where named; then, by kind, a rule of the layer's rank r among n layers (`layer_ranks`), the model's query
    heads a kv head (`gqa`) and its experts (0 for a dense model)."""

    base: Format
    attn_v: Callable[[int, int, int, int], Format | None] = lambda r, n, gqa, experts: None
    attn_output: Format | None = None
    ffn_down: Callable[[int, int], Format | None] = lambda r, n: None
    experts: Format | None = None  # every 3-D matrix (a mixture's experts, DeepSeek's attn_k_b / attn_v_b) first
    output: Format = Format.Q6_K
    token_embd: Format | None = None
    attn_q: Format | None = None
    attn_k: Format | None = None


def _more_bits(fmt: Format) -> Callable[..., Format | None]:
    # Q4_K_M / Q5_K_M: attn_v and ffn_down get `fmt` on the `use_more_bits` layers
    return lambda r, n, *_: fmt if use_more_bits(r, n) else None


# The file types llama-quantize makes from an f16/bf16 source without an importance matrix; rules that need one
# (IQ4_XS's and Q4_0's ffn_down guards) are left out, as llama.cpp leaves them out without it. IQ3_XXS and IQ2_M
# take one (llama-quantize refuses IQ2_S and IQ2_XXS matrices without it): theirs are the rules with one.
# IQ-recipes' output projection is Q5_K; IQ2_M's and IQ3_XXS's embedding IQ3_S.
RECIPES: dict[Mix, Recipe] = {
    Mix.Q8_0: Recipe(Format.Q8_0),
    Mix.Q6_K: Recipe(Format.Q6_K),
    Mix.Q5_K_M: Recipe(Format.Q5_K, attn_v=_more_bits(Format.Q6_K), ffn_down=_more_bits(Format.Q6_K)),
    Mix.Q4_K_M: Recipe(Format.Q4_K, attn_v=_more_bits(Format.Q6_K), ffn_down=_more_bits(Format.Q6_K)),
    Mix.Q4_K_M_05B: Recipe(Format.Q4_K, attn_v=_more_bits(Format.Q6_K), ffn_down=_more_bits(Format.Q6_K)),
    Mix.Q5_0: Recipe(Format.Q5_0),
    Mix.Q4_0: Recipe(Format.Q4_0),
    # IQ4_XS: attn_v Q5_K where 4+ query heads share a kv head; ffn_down Q5_K on the first eighth of layers
    Mix.IQ4_XS: Recipe(
        Format.IQ4_XS,
        attn_v=lambda r, n, gqa, *_: Format.Q5_K if gqa >= 4 else None,
        ffn_down=lambda r, n: Format.Q5_K if r < n // 8 else None,
    ),
    # Q3_K_M: attn_v Q5_K on the first two layers, Q4_K after; attn_output Q4_K; ffn_down Q5_K on the first
    # sixteenth, Q4_K after (llama.cpp keeps Q3_K there only for Falcon)
    Mix.Q3_K_M: Recipe(
        Format.Q3_K,
        attn_v=lambda r, n, *_: Format.Q5_K if r < 2 else Format.Q4_K,
        attn_output=Format.Q4_K,
        ffn_down=lambda r, n: Format.Q5_K if r < n // 16 else Format.Q4_K,
    ),
    # Q2_K: attn_v Q4_K where 4+ query heads share a kv head, else Q3_K; attn_output and ffn_down Q3_K
    Mix.Q2_K: Recipe(
        Format.Q2_K,
        attn_v=lambda r, n, gqa, *_: Format.Q4_K if gqa >= 4 else Format.Q3_K,
        attn_output=Format.Q3_K,
        ffn_down=lambda r, n: Format.Q3_K,
    ),
    # MXFP4_MOE: every 3-D tensor (the experts', DeepSeek's per-head attn_k_b / attn_v_b) MXFP4, every other matrix
    # (the output too) Q8_0; a dense model all Q8_0
    Mix.MXFP4_MOE: Recipe(Format.Q8_0, experts=Format.MXFP4),
    # IQ3_M: IQ3_S; attn_v and attn_output Q4_K; ffn_down Q4_K on the first eighth of layers
    Mix.IQ3_M: Recipe(
        Format.IQ3_S,
        attn_v=lambda *_: Format.Q4_K,
        attn_output=Format.Q4_K,
        ffn_down=lambda r, n: Format.Q4_K if r < n // 8 else None,
    ),
    # IQ3_XXS: q and k IQ2_S; attn_v Q4_K where 4+ query heads share a kv head; attn_output IQ3_S
    Mix.IQ3_XXS: Recipe(
        Format.IQ3_XXS,
        attn_v=lambda r, n, gqa, *_: Format.Q4_K if gqa >= 4 else None,
        attn_output=Format.IQ3_S,
        output=Format.Q5_K,
        token_embd=Format.IQ3_S,
        attn_q=Format.IQ2_S,
        attn_k=Format.IQ2_S,
    ),
    # IQ2_M: IQ2_S; attn_v Q4_K where 4+ query heads share a kv head or 4+ experts, else IQ3_S; attn_output IQ3_S;
    # ffn_down IQ3_S on the first eighth of layers
    Mix.IQ2_M: Recipe(
        Format.IQ2_S,
        attn_v=lambda r, n, gqa, experts: Format.Q4_K if gqa >= 4 or experts >= 4 else Format.IQ3_S,
        attn_output=Format.IQ3_S,
        ffn_down=lambda r, n: Format.IQ3_S if r < n // 8 else None,
        output=Format.Q5_K,
        token_embd=Format.IQ3_S,
    ),
}
