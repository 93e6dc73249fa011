"""fuselane: compile quantized GGUF checkpoints into fused kernel plans and run generation."""

__version__ = "0.1.0"
