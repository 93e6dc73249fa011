"""Golden outputs, llama2.c style: greedy token ids of tiny synthetic models, recorded once, must not change.

Any change to the recognizer, the kernels, dequantization or sessions that alters what a model computes shows
up here as a different list of ids. Each model is a `write_synthetic` file (seed 1234) fed a fixed prompt of
ids for STEPS greedy steps, stop tokens ignored. The f64 lane must give the same ids as the f32 lane: the
recorded top-2 logit gaps are at least 5e-5 while f32 and f64 logits differ by at most about 3e-7 (logits
of size ~0.6), so a mismatch is a real change, not rounding; `test_margins` keeps that true of the goldens.

When a change is meant to alter the numbers, regenerate the lists with `python tests/test_golden.py` and say
why in the commit. `test_weights_unchanged` separates the two ways a golden can break: if it fails too, the
synthetic files changed (`fuselane.gguf.synth`), not the computation.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from fuselane.gguf.reader import open_gguf
from fuselane.gguf.synth import write_synthetic
from fuselane.runtime.model import load
from fuselane.runtime.sampling import GREEDY

SEED = 1234
PROMPT = [1, 2, 3, 100, 200, 300, 400, 7]
STEPS = 24
MIN_GAP = 1e-5  # smallest top-2 logit gap a golden step may have, far above f32-vs-f64 differences

# (shape, mix) -> greedy ids after PROMPT, recorded with `python tests/test_golden.py` on the f32 cpu lane
GOLDEN: dict[tuple[str, str], list[int]] = {
    ("tiny-qwen3", "f32"): [
        472,
        25,
        115,
        444,
        337,
        115,
        444,
        502,
        442,
        34,
        170,
        193,
        129,
        406,
        216,
        72,
        372,
        325,
        100,
        311,
        67,
        100,
        311,
        67,
    ],
    ("tiny-qwen3", "q8_0"): [
        206,
        458,
        272,
        316,
        334,
        334,
        334,
        334,
        334,
        334,
        334,
        334,
        334,
        171,
        34,
        28,
        149,
        279,
        229,
        158,
        357,
        316,
        79,
        62,
    ],
    ("tiny-qwen2", "q8_0"): [
        206,
        458,
        369,
        369,
        369,
        115,
        67,
        293,
        304,
        218,
        29,
        3,
        205,
        404,
        182,
        22,
        428,
        38,
        284,
        224,
        331,
        316,
        355,
        312,
    ],
}
# sha256 of each file's tensor bytes in file order (metadata left out, so a new metadata key is no break)
WEIGHTS_SHA256: dict[tuple[str, str], str] = {
    ("tiny-qwen3", "f32"): "5421af25fbf9c6017ff5d332ccab543dcfe8d34bd95ee5bba964f5d03c282d65",
    ("tiny-qwen3", "q8_0"): "92d7bba2769639d469ee202580753bdb591ed2f748e4bf96e010ef5a167ff43b",
    ("tiny-qwen2", "q8_0"): "c4d9a5c8e3b3aa110dc3d378e2d5de1f3a90e24638e67dd7e093dbcf5a30e9ec",
}


def checkpoint(directory: Path, shape: str, mix: str) -> Path:
    return write_synthetic(directory / f"{shape}-{mix}.gguf", shape, mix, seed=SEED)


def greedy(path: Path, dtype=np.float32) -> tuple[list[int], float]:
    """STEPS arg-max ids after PROMPT, stop tokens ignored, and the smallest top-2 logit gap on the way."""
    m = load(path, lane="cpu", dtype=dtype)
    try:
        session = m.session()
        logits = session.feed(PROMPT)
        ids, gap = [], np.inf
        for _ in range(STEPS):
            second, first = np.sort(logits)[-2:]
            gap = min(gap, float(first - second))
            ids.append(int(np.argmax(logits)))
            logits = session.extend(ids[-1:])
        return ids, gap
    finally:
        m.close()


def weights_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_gguf(path) as f:
        for t in f.tensors.values():
            digest.update(t.name.encode())
            digest.update(t.data.tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    d = tmp_path_factory.mktemp("golden")
    return {key: checkpoint(d, *key) for key in GOLDEN}


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: "-".join(k))
def test_weights_unchanged(files, key):
    assert weights_sha256(files[key]) == WEIGHTS_SHA256[key], "synthetic weights changed: regenerate the goldens"


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: "-".join(k))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_greedy_ids_match_the_golden(files, key, dtype):
    ids, _ = greedy(files[key], dtype)
    assert ids == GOLDEN[key]


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: "-".join(k))
def test_margins(files, key):
    # in f64, so the margin itself is not a product of f32 rounding
    _, gap = greedy(files[key], np.float64)
    assert gap > MIN_GAP


@pytest.mark.parametrize("key", GOLDEN, ids=lambda k: "-".join(k))
def test_generate_ids_follows_the_golden(files, key):
    # the API's own loop (chunked prefill, stop tokens, room checks) picks the same tokens
    m = load(files[key], lane="cpu")
    try:
        assert not set(GOLDEN[key]) & m.tokenizer.stop_ids  # so the whole list is expected
        assert list(m.generate_ids(m.session(), PROMPT, max_tokens=STEPS, sampling=GREEDY)) == GOLDEN[key]
    finally:
        m.close()


if __name__ == "__main__":
    # regenerate: print the GOLDEN and WEIGHTS_SHA256 entries to paste above
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for key in GOLDEN:
            path = checkpoint(Path(tmp), *key)
            ids, gap = greedy(path)
            print(f"{key}: {ids},  # smallest top-2 gap {gap:.2g}")
            print(f"{key}: {weights_sha256(path)!r},")
