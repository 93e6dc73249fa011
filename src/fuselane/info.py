"""What `fuselane info` reports about a checkpoint: architecture, shapes, quant mix, tokenizer.

`describe` returns plain data (the JSON form); `render` lays it out for a terminal.

The quantization a file is named for (`general.file_type`, e.g. Q4_K_M) is only the converter's label for a
recipe: a "Q4_K_M" file may hold mostly Q5_0 tensors, where a row is too short for K-quant blocks. So `info`
reports the label as the file's own claim, next to the format that actually holds most of the bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gguf.constants import Keys, LlamaFileType

from fuselane.gguf.reader import GgufFile, open_gguf
from fuselane.hub import resolve
from fuselane.models import config_of

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")
_FILE_TYPE_PREFIX = "MOSTLY_"  # LlamaFileType names; the label drops it, as file names do (Q4_K_M)


def describe(model: str | None) -> dict[str, Any]:
    """Facts about a checkpoint, read from its header and checked against its tensors."""
    with open_gguf(resolve(model)) as f:
        return summarize(f)


def summarize(f: GgufFile) -> dict[str, Any]:
    """`describe`'s facts for a file already opened (and so already checked) by the reader."""
    cfg = config_of(f.metadata, f.tensors)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for t in f.tensors.values():
        counts[t.format.name] += 1
        sizes[t.format.name] += t.nbytes
    meta = f.metadata
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return {
        "path": str(f.path),
        "name": meta.get("general.name"),
        "file_bytes": f.size,
        "gguf_version": f.version,
        "architecture": cfg.arch,
        "shape": {
            "n_embd": cfg.n_embd,
            "layers": cfg.n_layers,
            "heads": cfg.n_heads,
            "kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "ffn": cfg.n_ff,
            "vocab": cfg.vocab,
            "context": cfg.context,
            "rope_base": cfg.rope_base,
            "yarn": None if cfg.yarn is None else {"factor": cfg.yarn.factor, "original_context": cfg.yarn.original},
            "rms_eps": cfg.rms_eps,
            "tied_embeddings": cfg.tied,
            "qkv_bias": cfg.qkv_bias,
            "qk_norm": cfg.qk_norm,
        },
        "experts": _experts(cfg),
        "linear": _linear(cfg),
        "latent": _latent(cfg),
        "cache": cache_line(cfg),
        "quant_mix": {name: {"tensors": counts[name], "bytes": sizes[name]} for name, _ in counts.most_common()},
        "quant": {
            "label": _label(meta.get(Keys.General.FILE_TYPE)),
            "most_bytes": sizes.most_common(1)[0][0] if sizes else None,
        },
        "tensors": len(f.tensors),
        "tokenizer": {
            "model": meta.get("tokenizer.ggml.model"),
            "pre": meta.get("tokenizer.ggml.pre"),
            "tokens": len(tokens),
            "merges": len(meta.get("tokenizer.ggml.merges") or []),
            "bos": _token(tokens, meta.get("tokenizer.ggml.bos_token_id")),
            "eos": _token(tokens, meta.get("tokenizer.ggml.eos_token_id")),
            "chat_template": "tokenizer.chat_template" in meta,
        },
    }


def _experts(cfg: Any) -> dict[str, Any] | None:
    """A mixture's experts and their widths; None for a dense model."""
    if not cfg.moe:
        return None
    return {
        "count": cfg.experts,
        "used": cfg.experts_used,
        "ffn": cfg.expert_ff,
        "shared_ffn": cfg.shared_ff,
        "renormalised": cfg.renorm,
    }


def _linear(cfg: Any) -> dict[str, Any] | None:
    """A hybrid's gated delta-rule layers and the full-attention layers' rotary; None for other models."""
    la = cfg.linear
    if la is None:
        return None
    return {
        "layers": sum(la.layers),
        "key_heads": la.k_heads,
        "value_heads": la.v_heads,
        "head_dim": la.k_dim,
        "conv_taps": la.conv,
        "rope_dim": cfg.rope_dim,
    }


def _linear_line(la: dict[str, Any] | None, layers: int) -> list[str]:
    if la is None:
        return []
    return [
        f"  linear attn   {la['layers']} of {layers} layers gated delta rule ({la['key_heads']} key / "
        f"{la['value_heads']} value heads of {la['head_dim']}, a {la['conv_taps']}-tap convolution); the others "
        f"gated attention, rope on {la['rope_dim']} values a head"
    ]


def cache_line(cfg: Any) -> str:
    """The values the cache holds a token: a layer's, and what they are."""
    per_layer = cfg.cache_values
    if cfg.latent is not None:
        what = f"kv_lora_rank {cfg.latent.kv_lora} + rope {cfg.latent.rope}"
    else:
        what = f"keys and values of {cfg.n_kv_heads} kv heads of {cfg.head_dim}"
    # a hybrid's gated delta-rule layers keep a fixed-size state, not a row a token
    cached = cfg.n_layers if cfg.linear is None else cfg.linear.layers.count(False)
    if not cached:
        return "no rows a token: every layer keeps a fixed-size recurrent state"
    return f"{per_layer:,} values a token a layer ({what}), {per_layer * cached:,} over {cached} layers"


def _latent(cfg: Any) -> dict[str, Any] | None:
    """Latent attention's widths and DeepSeek's routing; None for another architecture."""
    lt = cfg.latent
    if lt is None:
        return None
    return {
        "q_lora_rank": lt.q_lora,
        "kv_lora_rank": lt.kv_lora,
        "nope": lt.nope,
        "rope": lt.rope,
        "value": lt.vdim,
        "dense_layers": lt.dense_layers,
        "shared_experts": lt.shared_experts,
        "gating": lt.gating.value,
        "correction_bias": lt.bias,
        "weights_scale": lt.weights_scale,
        "groups": lt.groups,
        "groups_used": lt.groups_used,
        "yarn_factor": lt.yarn.factor if lt.yarn is not None else None,
    }


def _latent_lines(lt: dict[str, Any] | None) -> list[str]:
    if lt is None:
        return []
    q = f"q LoRA {lt['q_lora_rank']}" if lt["q_lora_rank"] else "plain q"
    groups = f", top {lt['groups_used']} of {lt['groups']} groups" if lt["groups"] > 1 else ""
    bias = " with a correction bias" if lt["correction_bias"] else ""
    yarn = f", YaRN x{lt['yarn_factor']:g}" if lt["yarn_factor"] else ""
    return [
        f"  latent        {q}, kv_lora_rank {lt['kv_lora_rank']}, head nope {lt['nope']} + rope {lt['rope']}, "
        f"value {lt['value']}{yarn}",
        f"  routing       {lt['gating']}{bias}{groups}, weights x{lt['weights_scale']:g}; "
        f"{lt['dense_layers']} dense layers first, {lt['shared_experts']} shared experts",
    ]


def _experts_line(e: dict[str, Any] | None, gated: bool) -> list[str]:
    if e is None:
        return []
    gated = " (sigmoid-gated)" if gated else ""  # DeepSeek's shared experts are added ungated
    shared = f"a shared expert of ffn {e['shared_ffn']}{gated}" if e["shared_ffn"] else "no shared expert"
    kept = "renormalised over the kept" if e["renormalised"] else "as the softmax gives them"
    return [
        f"  experts       {e['count']} experts of ffn {e['ffn']}, {e['used']} kept a token (weights {kept}), {shared}"
    ]


def _label(file_type: Any) -> str | None:
    """The quantization the file says it is (`general.file_type`), by its usual name; None if it says none."""
    if not isinstance(file_type, int):
        return None
    try:
        return LlamaFileType(file_type).name.removeprefix(_FILE_TYPE_PREFIX)
    except ValueError:
        return f"unknown file type {file_type:,}"


def _token(tokens: list[str], idx: Any) -> str | None:
    return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None


def _yarn_text(yarn: dict | None) -> str:
    """ ", YaRN x4 over 32768" where the file stretches its rotary frequencies."""
    return "" if yarn is None else f", YaRN x{yarn['factor']:g} over {yarn['original_context']}"


def render(info: dict[str, Any]) -> str:
    """A human-readable report of `describe`'s facts."""
    s, t, q = info["shape"], info["tokenizer"], info["quant"]
    label = f"{q['label']} (the file's own label, general.file_type)" if q["label"] else "none (no general.file_type)"
    lines = [
        f"{info['name'] or '(unnamed)'}  [{info['path']}]",
        f"  architecture  {info['architecture']}   file {info['file_bytes'] / 1e6:.1f} MB, "
        f"GGUF v{info['gguf_version']}, {info['tensors']} tensors",
        f"  shape         n_embd {s['n_embd']}, {s['layers']} layers, {s['heads']} heads / {s['kv_heads']} kv, "
        f"head_dim {s['head_dim']}, ffn {s['ffn']}, vocab {s['vocab']}",
        f"  context       {s['context']} tokens, rope base {s['rope_base']:g}{_yarn_text(s.get('yarn'))}, "
        f"rms eps {s['rms_eps']:g}",
        f"  features      qkv bias {s['qkv_bias']}, q/k norm {s['qk_norm']}, tied embeddings {s['tied_embeddings']}",
        *_linear_line(info.get("linear"), s["layers"]),
        *_experts_line(info.get("experts"), gated=info.get("latent") is None),
        *_latent_lines(info.get("latent")),
        f"  cache         {info['cache']}",
        f"  quant label   {label}; most bytes are {q['most_bytes'] or 'in no tensor'}",
        "  quant mix     "
        + ", ".join(f"{name} x{v['tensors']} ({v['bytes'] / 1e6:.1f} MB)" for name, v in info["quant_mix"].items()),
        f"  tokenizer     {t['model']} / {t['pre']}, {t['tokens']} tokens, {t['merges']} merges, "
        f"bos {t['bos']}, eos {t['eos']}, chat template {'yes' if t['chat_template'] else 'no'}",
    ]
    return "\n".join(lines)
