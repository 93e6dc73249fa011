"""One row of `llama_cpp.sh`'s side-by-side table: llama-bench's JSON and `fuselane bench --json` on one file.

Usage: python benchmarks/side_by_side.py SHAPE MIX FILE LLAMA.json FUSELANE.json
Prints a Markdown row: the file's size, each tool's pp512 and tg128 tokens/s and fuselane's ratio to llama.cpp;
a figure a tool did not give (it failed: its .err file beside the JSON says why) is a dash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def llama_rates(path: Path) -> tuple[float | None, float | None]:
    """(pp, tg) tokens/s from llama-bench's `-o json`: one record a test, `avg_ts` its mean rate."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    pp = next((r["avg_ts"] for r in records if r.get("n_prompt") and not r.get("n_gen")), None)
    tg = next((r["avg_ts"] for r in records if r.get("n_gen") and not r.get("n_prompt")), None)
    return pp, tg


def fuselane_rates(path: Path) -> tuple[float | None, float | None]:
    """(pp, tg) tokens/s at depth 0 from `fuselane bench --json`."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    first = next((r for r in results if not r.get("depth")), None)
    return (first["prefill_tok_s"], first["decode_tok_s"]) if first else (None, None)


def cell(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def main() -> None:
    shape, mix, file, llama_json, fuselane_json = sys.argv[1:6]
    gb = Path(file).stat().st_size / 1e9 if Path(file).exists() else float("nan")
    lpp, ltg = llama_rates(Path(llama_json))
    fpp, ftg = fuselane_rates(Path(fuselane_json))
    row = [shape, mix, f"{gb:.2f}", cell(lpp), cell(fpp), ratio(fpp, lpp), cell(ltg), cell(ftg), ratio(ftg, ltg)]
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
