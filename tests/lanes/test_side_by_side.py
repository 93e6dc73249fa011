"""`benchmarks/side_by_side.py` reads llama-bench's JSON records and `fuselane bench --json` into one table row:
the prompt's and the decode's rates of each, fuselane's ratio to llama.cpp, and a dash for a figure a tool did
not give."""

from __future__ import annotations

import json
import sys

from tests.benchmark_script import load_script

# llama-bench `-o json`: one record a test (a prompt-only test has n_gen 0, a decode-only test n_prompt 0)
LLAMA = [
    {"model_type": "qwen2 7B Q4_K - Medium", "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 9490.17},
    {"model_type": "qwen2 7B Q4_K - Medium", "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 277.49},
]
FUSELANE = [
    {"depth": 0, "prefill_tok_s": 24029.3, "decode_tok_s": 433.8},
    {"depth": 4096, "prefill_tok_s": 21000.0, "decode_tok_s": 400.0},
]


def test_a_row_of_both_tools(tmp_path, capsys, monkeypatch) -> None:
    sbs = load_script("side_by_side")
    (tmp_path / "l.json").write_text(json.dumps(LLAMA))
    (tmp_path / "f.json").write_text(json.dumps(FUSELANE))
    (tmp_path / "m.gguf").write_bytes(b"\0" * 1000)
    assert sbs.llama_rates(tmp_path / "l.json") == (9490.17, 277.49)
    assert sbs.fuselane_rates(tmp_path / "f.json") == (24029.3, 433.8)
    args = ["qwen2.5-7b", "q4_k_m", str(tmp_path / "m.gguf"), str(tmp_path / "l.json"), str(tmp_path / "f.json")]
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", *args])
    sbs.main()
    row = capsys.readouterr().out.strip()
    assert row == "| qwen2.5-7b | q4_k_m | 0.00 | 9,490.2 | 24,029.3 | 2.53x | 277.5 | 433.8 | 1.56x |"


def test_a_tool_that_gave_nothing_is_a_dash(tmp_path) -> None:
    sbs = load_script("side_by_side")
    (tmp_path / "empty.json").write_text("")
    assert sbs.llama_rates(tmp_path / "empty.json") == (None, None)
    assert sbs.fuselane_rates(tmp_path / "missing.json") == (None, None)
    assert sbs.ratio(None, 277.5) == "-" and sbs.ratio(433.8, None) == "-"
