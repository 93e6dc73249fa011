"""Recognizers: one module per architecture family, chosen by `general.architecture`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fuselane.errors import ModelError
from fuselane.models import deepseek2, qwen, qwen3next
from fuselane.models.config import ModelConfig, read_config

RECOGNIZERS = {
    "qwen2": qwen,
    "qwen3": qwen,
    "qwen2moe": qwen,
    "qwen3moe": qwen,
    "qwen3next": qwen3next,
    "deepseek2": deepseek2,
}


def config_of(meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> ModelConfig:
    """The model's config, checked against its tensors; an unknown architecture is a ModelError naming it."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError("metadata key 'general.architecture' is missing")
    if arch not in RECOGNIZERS:
        known = ", ".join(sorted(RECOGNIZERS))
        raise ModelError(f"architecture '{arch}' is not supported (fuselane runs: {known})")
    cfg = getattr(RECOGNIZERS[arch], "read_config", read_config)(meta, tensors, arch)
    RECOGNIZERS[arch].check_weights(cfg, tensors)
    return cfg


def recognizer(cfg: ModelConfig):
    """The recognizer module for a config's architecture."""
    return RECOGNIZERS[cfg.arch]


__all__ = ["ModelConfig", "config_of", "recognizer"]
