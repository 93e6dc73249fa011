"""The Qwen shapes `synth` writes: the hyper-parameters of a dense or mixture model (`Shape`) and the real
models' shapes by name (`SHAPES`, with DeepSeek's latent shapes from `synth_latent`).

Why apart from the writer: the shape table is data that benchmarks, tests and the CLI read by name, and the
writer's streaming code is another job.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuselane.errors import FuselaneError
from fuselane.gguf import synth_qwen3next as hybrid
from fuselane.gguf.synth_latent import LATENT_SHAPES, LatentShape

ARCHS = ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "qwen3next")
MOE_ARCHS = ("qwen2moe", "qwen3moe", "qwen3next")
SHARED_EXPERT_ARCHS = ("qwen2moe", "qwen3next")


@dataclass(frozen=True, slots=True)
class Shape:
    """Hyper-parameters of a Qwen model (qwen2: q/k/v biases; qwen3: q/k RMS norms; their `moe` forms: a
    mixture of `experts` experts, `experts_used` kept a token, each `expert_ff` wide, and for qwen2moe a shared
    expert `shared_ff` wide)."""

    arch: str
    n_embd: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int
    vocab: int
    context: int = 32768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied: bool = False  # the output projection is the embedding table: no output.weight
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    # qwen3next: every `full_every`-th layer full attention, the others gated delta-rule layers with
    # `ssm_k_heads` key and `ssm_v_heads` value heads of `ssm_dim` values and a `conv`-tap convolution; rope
    # turns the first `rope_dim` values of a head
    full_every: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_dim: int = 0
    conv: int = 0
    rope_dim: int = 0
    # YaRN (`rope.scaling.type` yarn) where `yarn_factor` is above 1, over an original context of `yarn_original`
    yarn_factor: float = 1.0
    yarn_original: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise FuselaneError(f"architecture '{self.arch}' is not one of {', '.join(ARCHS)}")
        if self.moe:
            self._check_experts()
        if self.arch == hybrid.ARCH:
            hybrid.check(self)
        sizes = ("n_embd", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_ff", "vocab", "context")
        for size in sizes:
            if getattr(self, size) <= 0:
                raise FuselaneError(f"shape field {size} must be positive, not {getattr(self, size)}")
        if self.n_heads % self.n_kv_heads:
            raise FuselaneError(f"{self.n_heads} heads do not group evenly over {self.n_kv_heads} kv heads")
        if self.head_dim % 2:
            raise FuselaneError(f"head_dim {self.head_dim} is odd; rope rotates pairs of dimensions")

    @property
    def moe(self) -> bool:
        return self.arch in MOE_ARCHS

    @property
    def family(self) -> str:
        """The attention's family: qwen2 (q/k/v biases) or qwen3 (q/k norms)."""
        return self.arch.removesuffix("moe")

    def _check_experts(self) -> None:
        for size in ("experts", "experts_used", "expert_ff"):
            if getattr(self, size) <= 0:
                raise FuselaneError(f"shape field {size} must be positive for {self.arch}, not {getattr(self, size)}")
        if self.experts_used > self.experts:
            raise FuselaneError(f"{self.experts_used} experts a token is more than the {self.experts} experts")
        if (self.shared_ff > 0) != (self.arch in SHARED_EXPERT_ARCHS):
            raise FuselaneError("qwen2moe and qwen3next have a shared expert (shared_ff > 0); qwen3moe has none")


# The real models' shapes (shared/ANCHORS.md). All are untied, as the files measured there: the real 0.5B
# Q4_K_M file carries output.weight, and the 0.80 GB Qwen3-0.6B Q8_0 size counts one.
# Qwen3 files declare a 40,960-token context, Qwen2.5's 32,768.
SHAPES: dict[str, Shape | LatentShape] = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 151936),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, context=40960),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 151936),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, context=40960),
    "qwen2.5-32b": Shape("qwen2", 5120, 64, 40, 8, 128, 27648, 151936),
    # the other dense sizes of the two families (their config.json widths; vocabularies as above, untied)
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 128, 11008, 151936),
    "qwen2.5-14b": Shape("qwen2", 5120, 48, 40, 8, 128, 13824, 151936),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, context=40960),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, context=40960),
    "qwen3-14b": Shape("qwen3", 5120, 40, 40, 8, 128, 17408, 151936, context=40960),
    "qwen3-32b": Shape("qwen3", 5120, 64, 64, 8, 128, 25600, 151936, context=40960),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 16, 128, 512, context=4096),
    "tiny-qwen3": Shape("qwen3", 64, 2, 4, 2, 16, 128, 512, context=4096),
    # Mixtures: n_ff is the dense width the real files state (unused by the mixture layers).
    "qwen3-30b-a3b": Shape(
        "qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, context=40960, experts=128, experts_used=8, expert_ff=768
    ),
    "qwen1.5-moe-a2.7b": Shape(
        "qwen2moe",
        2048,
        24,
        16,
        16,
        128,
        5632,
        151936,
        context=8192,
        experts=60,
        experts_used=4,
        expert_ff=1408,
        shared_ff=5632,
    ),
    "tiny-qwen3moe": Shape(
        "qwen3moe", 64, 2, 4, 2, 16, 128, 512, context=4096, experts=8, experts_used=2, expert_ff=32
    ),
    "tiny-qwen2moe": Shape(
        "qwen2moe", 64, 2, 4, 2, 16, 128, 512, context=4096, experts=8, experts_used=2, expert_ff=32, shared_ff=64
    ),
    # Qwen3-Next-80B-A3B: three of every four layers gated delta rule; full attention with 16 heads of 256,
    # a quarter of each head rotated; 512 experts, 10 kept, each 512 wide, and a shared expert of 512.
    "qwen3-next-80b-a3b": Shape(
        "qwen3next",
        2048,
        48,
        16,
        2,
        256,
        5120,
        151936,
        context=262144,
        rope_base=10_000_000.0,
        experts=512,
        experts_used=10,
        expert_ff=512,
        shared_ff=512,
        full_every=4,
        ssm_k_heads=16,
        ssm_v_heads=32,
        ssm_dim=128,
        conv=4,
        rope_dim=64,
    ),
    "tiny-qwen3next": Shape(
        "qwen3next",
        64,
        4,
        4,
        2,
        16,
        128,
        512,
        context=4096,
        experts=4,
        experts_used=2,
        expert_ff=32,
        shared_ff=32,
        full_every=2,
        ssm_k_heads=2,
        ssm_v_heads=4,
        ssm_dim=16,
        conv=4,
        rope_dim=8,
    ),
    **LATENT_SHAPES,  # deepseek2 (`synth_latent`)
}


def resolve_shape(shape: Shape | str) -> tuple[str, Shape]:
    """A display name and the Shape, from a Shape or a SHAPES key; FuselaneError for an unknown key."""
    if isinstance(shape, Shape | LatentShape):
        return f"{shape.arch}-{shape.n_embd}x{shape.n_layers}", shape
    if shape not in SHAPES:
        raise FuselaneError(f"unknown shape '{shape}': choose one of {', '.join(SHAPES)}")
    return shape, SHAPES[shape]
