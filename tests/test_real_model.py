"""The real Qwen2.5-Coder-0.5B checkpoint on the cpu lane against transformers loading the same GGUF.

transformers dequantizes the file with `gguf` and runs its own Qwen2 classes in float32: an implementation
independent of ours from the bytes on. Both run f32, so logits agree to accumulated rounding (<= 1e-3
relative to the largest logit), and greedy continuations agree token for token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fuselane.runtime.model import load  # noqa: E402
from fuselane.runtime.sampling import GREEDY  # noqa: E402

pytestmark = pytest.mark.real

REL_TOL = 1e-3
GREEDY_TOKENS = 16
PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", False),
    ("def quicksort(items):\n", True),
    ("// Compute the greatest common divisor in C\nint gcd(int a, int b) {", True),
]


@pytest.fixture(scope="module")
def ours(qwen_gguf):
    model = load(qwen_gguf, lane="cpu", ctx=512)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf(qwen_gguf):
    path = Path(qwen_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def test_prompt_logits_match_transformers(ours, hf):
    ids = ours.prompt_ids(PROMPTS[0][0])
    mine = ours.logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].double().numpy()
    err = np.max(np.abs(mine - theirs)) / np.max(np.abs(theirs))
    assert err <= REL_TOL, err


@pytest.mark.parametrize(("prompt", "raw"), PROMPTS)
def test_greedy_continuation_matches_transformers(ours, hf, prompt, raw):
    ids = ours.prompt_ids(prompt, raw=raw)
    mine = list(ours.generate_ids(ours.session(), ids, max_tokens=GREEDY_TOKENS, sampling=GREEDY))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            eos_token_id=sorted(ours.tokenizer.stop_ids),
            pad_token_id=ours.tokenizer.eos_id,
        )
    theirs = [t for t in out[0, len(ids) :].tolist() if t not in ours.tokenizer.stop_ids]
    assert len(mine) == GREEDY_TOKENS or len(mine) == len(theirs)
    assert mine == theirs[: len(mine)]
