"""The grouped expert GEMM's word decode (`triton.moe.words`) against `fuselane.gguf.dequant`, bit for bit.

Each value must be the reference's f32 rounded once to f16 (compared as the f16's bits, so a NaN or a signed
zero counts too). Rows of 768 values put Q6_K's 210-byte blocks at both alignments a word load meets (a row
of 630 bytes: every other row starts 2 bytes past a word), and Q4_K's at several rows and units.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU
pytest.importorskip("triton")

from kernel_checks import DEVICE, dev, raw_weights  # noqa: E402

from fuselane.gguf.dequant import dequantize  # noqa: E402
from fuselane.gguf.formats import Format  # noqa: E402
from fuselane.lanes.cuda.triton.moe import words  # noqa: E402

ROWS, VALUES = 8, 768


@pytest.mark.parametrize("step", words.STEPS)
@pytest.mark.parametrize("fmt", sorted(words.FORMATS, key=int), ids=lambda f: f.name)
def test_word_decode_is_gguf_dequant_rounded_once(fmt: Format, step: int) -> None:
    raw = raw_weights(fmt, ROWS, VALUES, np.random.default_rng(int(fmt)))
    want = dequantize(raw, fmt, (ROWS, VALUES), dtype=np.float32).astype(np.float16)
    out = torch.zeros(ROWS, VALUES, dtype=torch.float16, device=DEVICE)
    words.decode(dev(raw), fmt, ROWS, VALUES, out, step=step)
    got = out.cpu().numpy()
    bad = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    first = tuple(bad[0]) if bad.size else None
    assert bad.size == 0, f"{len(bad)} values differ, first at {first}: {got[first]} != {want[first]}"
