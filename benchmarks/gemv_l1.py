"""The L1 traffic of a cuda-lane decode step's kernels, by Nsight Compute (`ncu`): the bytes each kernel's global
loads move through L1 for each byte they read from DRAM, and how busy the L1 data pipe is.

Why: the low-bit int8 GEMVs are bound by the L1 traffic their loads make, not by their count nor by DRAM
(RESULTS.md, 2026-12-05: the 7B's Q3_K GLU moves 8.8 bytes through L1 a DRAM byte with the L1 data pipe 68 %
busy, Q4_K's 1.6 at 33 %; a Q3_K body with 22 % fewer load requests touched 9 % more sectors and was 13 %
slower). A body's change is weighed by this ratio, and a step timed only once it falls.

It runs `ncu` over itself: the child process loads the model with dependent launches off (so a kernel's time
is its own), feeds a short prompt and runs a few eager decode steps; `ncu` profiles the kernels that match
`--kernel` after the first `--skip` of them (the prompt's and the first steps' launches compile and warm up).

Usage: python benchmarks/gemv_l1.py MODEL.gguf [--kernel REGEX] [--skip 3] [--count 1] [--knob K=V ...]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

SECTOR_BYTES = 32  # an L1 sector
PROMPT = 8  # tokens fed before the eager steps
STEPS = 4  # eager decode steps the child runs
METRICS = {
    "time": "gpu__time_duration.sum",
    "dram": "dram__bytes_read.sum",
    "sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "pipe": "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_active",
    # the L1 data pipe's unit of work (a sector count does not tell a load that touched four sectors of one line
    # from one that touched four lines): the measure `run_loads=vector`'s loss (fewer sectors, slower) points to
    "wavefronts": "l1tex__data_pipe_lsu_wavefronts.sum",
    "warps": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "instructions": "smsp__inst_executed.sum",
}
# ncu's units, as the factor to bytes or to microseconds
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-3, "us": 1, "usecond": 1, "ms": 1e3}
_KERNEL = re.compile(r"^\s+(\w+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_METRIC = re.compile(r"^\s+([\w.]+)\s+(\S+)?\s+([\d,.]+)\s*$")


@dataclass(slots=True)
class Launch:
    """One profiled launch: its kernel and each metric of METRICS by its short name (bytes, us, counts, %)."""

    kernel: str
    values: dict[str, float]

    @property
    def l1_per_dram_byte(self) -> float:
        """Bytes the loads' sectors move through L1 for each byte read from DRAM."""
        return self.values["sectors"] * SECTOR_BYTES / max(self.values["dram"], 1.0)


def parse(report: str) -> list[Launch]:
    """The launches of an `ncu --metrics` report (its default text form), each with METRICS' values."""
    names = {v: k for k, v in METRICS.items()}
    launches: list[Launch] = []
    for line in report.splitlines():
        if m := _KERNEL.match(line):
            launches.append(Launch(m.group(1), {}))
        elif launches and (m := _METRIC.match(line)) and m.group(1) in names:
            unit, value = m.group(2), float(m.group(3).replace(",", ""))
            launches[-1].values[names[m.group(1)]] = value * UNITS.get(unit or "", 1)
    return launches


def table(launches: list[Launch]) -> str:
    """One line a launch: time, DRAM read, L1 sectors and their bytes a DRAM byte, the L1 data pipe's wavefronts
    ('-' where ncu gave none), pipe and warps busy."""
    head = f"{'kernel':24} {'us':>7} {'DRAM MB':>8} {'L1 sectors':>11} {'L1/DRAM':>7} {'wavefronts':>11} "
    rows = [head + f"{'pipe %':>6} {'warps %':>7}"]
    for launch in launches:
        v = launch.values
        waves = f"{v['wavefronts']:11,.0f}" if "wavefronts" in v else f"{'-':>11}"
        rows.append(
            f"{launch.kernel:24} {v['time']:7.2f} {v['dram'] / 1e6:8.2f} {v['sectors']:11,.0f} "
            f"{launch.l1_per_dram_byte:7.1f} {waves} {v['pipe']:6.1f} {v['warps']:7.1f}"
        )
    return "\n".join(rows)


def run_steps(model: str, knobs: list[str]) -> None:
    """The child: a short prompt, then eager decode steps, dependent launches off."""
    import numpy as np

    from fuselane.runtime.model import load

    m = load(model, lane="cuda", ctx=256, knobs=[*knobs, "pdl=off"])
    session = m.session()
    session.feed([100 + t for t in range(PROMPT)])
    pos = len(session.tokens)
    for t in range(STEPS):
        m.lane.forward(np.array([t]), pos + t)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--kernel", default="_q8_glu_q8", help="a regular expression of the kernels' names")
    ap.add_argument("--skip", type=int, default=3, help="matching launches to skip (compiling, warming up)")
    ap.add_argument("--count", type=int, default=1, help="matching launches to profile")
    ap.add_argument("--knob", action="append", default=[], help="a lane knob, K=V (repeatable)")
    ap.add_argument("--steps", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = ap.parse_args(argv)
    if args.steps:
        run_steps(args.model, args.knob)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("gemv_l1: ncu (Nsight Compute) is not on PATH")
    child = [sys.executable, __file__, args.model, "--steps", *(f"--knob={k}" for k in args.knob)]
    cmd = [ncu, "--clock-control", "none", "-k", f"regex:{args.kernel}", "--launch-skip", str(args.skip)]
    cmd += ["--launch-count", str(args.count), "--metrics", ",".join(METRICS.values()), *child]
    report = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    launches = parse(report)
    if not launches:
        sys.exit(f"gemv_l1: ncu profiled no launch of /{args.kernel}/:\n{report[-2000:]}")
    print(table(launches))


if __name__ == "__main__":
    main()
