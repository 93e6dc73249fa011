"""A file of every grid and ternary format, read by Hugging Face transformers' GGUF loader (its own decode of the
formats, its Qwen2 class) and by the cpu lane: the same prompt logits. An independent check of the layouts, the
decoders and the lane's use of them, beyond `gguf.quants` (tests/gguf/test_dequant.py)."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from fuselane.gguf.synth import Shape, tensor_type_overrides, write_synthetic  # noqa: E402
from fuselane.runtime.model import load  # noqa: E402

# rows of whole 256-value super-blocks, so no matrix falls back to another format
SHAPE = Shape("qwen2", 256, 2, 4, 2, 64, 512, 512, context=4096)
PROMPT = [5, 17, 101, 42, 300, 7]
# transformers multiplies in f32 (its GGUF kernels cast), the cpu lane here in f64: a few f32 ulps a layer
REL_TOL = 1e-4
# each projection in another format; the ternary ones (only BitNet-like models use them) in a second file
GRID = ["attn_q=iq3_s", "attn_k=iq1_s", "attn_v=iq2_xs", "attn_output=iq3_xxs", "ffn_gate=iq1_m", "ffn_up=iq2_xxs",
        "ffn_down=iq2_s"]  # fmt: skip
TERNARY = ["attn_(q|k|v|output)=tq1_0", "ffn=tq2_0"]


@pytest.mark.parametrize("types", [GRID, TERNARY], ids=["grid", "ternary"])
def test_transformers_reads_the_same_model(tmp_path, types):
    formats = tensor_type_overrides(SHAPE, "q8_0", types)
    assert len(set(formats.values())) == len({t.split("=")[1] for t in types})
    path = write_synthetic(tmp_path / "m.gguf", SHAPE, "q8_0", seed=4, formats=formats)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    ours = np.asarray(load(path, lane="cpu", ctx=64, dtype=np.float64).logits(PROMPT))
    ours = ours[-1] if ours.ndim == 2 else ours
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= REL_TOL
