"""Compile every kernel a model's steps launch on the cuda lane for a GPU architecture, on a machine without one.

Triton's interpreter (how CI runs the kernels) takes code its compiler refuses: a global read that is not a
`tl.constexpr`, a layout the backend cannot lower, a tile that overflows shared memory. This check runs a
model's steps on the cuda lane with host tensors and each launch replaced by Triton's compile of that very launch
(the same arguments, so the same specializations and constexprs) for the target, through PTX to a cubin: a
kernel that does not compile fails here as it would on the GPU. Nothing is computed, so the step's numbers are
meaningless; what it proves is that every launch of the plan compiles, and (`--usage`) what each kernel takes
in registers (the range over its specializations) and stack bytes a thread (spills, local arrays), read from
the cubin by the `cuobjdump` Triton ships: a spill is a kernel slower than its design, and a wide range of
registers a launch holding fewer blocks a SM than the kernel's others, seen before any GPU runs it.

The steps: a wide prompt chunk (past the GEMV's rows), a narrow one, a sampled decode loop, and, where the
model takes it, a batch of two sequences on the paged form. It must run in a process where no fuselane kernel
was decorated under the interpreter (Triton decides at decoration): `python -m fuselane.lanes.cuda.compile_check`.

    python -m fuselane.lanes.cuda.compile_check MODEL [--knob K=V ...] [--mix MIX] [--layers N] [--vocab N]
        [--experts N] [--arch 90] [--usage] [--seqs N]

A synthetic shape's name is written to a temporary file first; `--layers`, `--vocab` and `--experts` cut it (a
layer's kernels are its widths', so a layer or two of a real shape, with fewer experts of the same width,
compile what every layer of it launches).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

INTERPRET = "TRITON_INTERPRET"
# tokens of the wide chunk: past the GEMV's rows, so the chunk's GEMMs run, and past the rows a rotation launch
# takes a head a program (`attn_kernels.ROPE_ONE_HEAD_ROWS`), so its tiles of rows and heads compile too
WIDE_PROMPT = 80
NARROW_PROMPT = 3  # ...and of the narrow one, within them
DECODE_TOKENS = 3  # decode steps of the sampled loop
CTX = 128  # cache rows: the steps above and a batch's blocks fit
BATCH = 2  # sequences of the batch (`--seqs`: its bucket's rows are the kernels' tile of rows)


@dataclass(slots=True)
class Report:
    """What compiled: launches seen, each kernel's launches, the steps run, and the first failure (the kernel's
    name, Triton's message)."""

    launches: int = 0
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> launches compiled
    failure: tuple[str, str] | None = None
    steps: list[str] = field(default_factory=list)
    # name -> (fewest registers, most registers, most stack bytes) a thread over its specializations: a
    # kernel whose registers spread widely takes fewer blocks a SM in some launches than in others
    usage: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def note_usage(self, name: str, regs: int, stack: int) -> None:
        """One compiled specialization of kernel `name`: its registers and stack bytes a thread."""
        low, high, most = self.usage.get(name, (regs, regs, stack))
        self.usage[name] = (min(low, regs), max(high, regs), max(most, stack))

    def render(self) -> str:
        lines = [f"{self.launches} launches of {len(self.kernels)} kernels compiled ({'; '.join(self.steps)})"]
        for name, count in sorted(self.kernels.items()):
            said = ""
            if name in self.usage:
                low, high, spilled = self.usage[name]
                regs = f"{high:3d}" if low == high else f"{low}-{high}"
                said = f"  {regs:>7s} registers  {spilled:5d} stack bytes a thread"
            lines.append(f"  {name:40s} {count:4d} launches{said}")
        if self.failure is not None:
            lines.append(f"FAILED {self.failure[0]}: {self.failure[1]}")
        return "\n".join(lines)


class _Target:
    """The driver Triton asks for the device: one of `arch`, no stream (launches never happen)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _kernel_modules() -> None:
    """Import every kernel module now, compiled mode: the lane imports some lazily."""
    import fuselane.lanes.cuda.triton as kernels

    for module in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        importlib.import_module(module.name)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What the cuobjdump Triton ships prints of a compiled kernel's cubin under `flag` (`-sass` for its
    instructions, `--dump-resource-usage` for its registers and stack)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of a compiled kernel, from its cubin."""
    said = cuobjdump(cubin, "--dump-resource-usage")
    regs, stack = re.search(r"REG:(\d+)", said), re.search(r"STACK:(\d+)", said)
    return (int(regs.group(1)) if regs else 0), (int(stack.group(1)) if stack else 0)


@contextlib.contextmanager
def compiling(arch: int, report: Report, *, usage: bool = False) -> Iterator[None]:
    """Every Triton launch inside compiles for `arch` instead of running, recorded in `report` (with each
    kernel's registers and spills where `usage`)."""
    if os.environ.get(INTERPRET) == "1" or any(m.startswith("fuselane.lanes.cuda.triton") for m in sys.modules):
        raise RuntimeError("compile_check needs a process whose kernels were not decorated under the interpreter")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Target(arch))
    _kernel_modules()
    launch = JITFunction.run
    measured: set[int] = set()  # compiled kernels already read (a launch of a cached specialization is the same)

    def compile_instead(self, *args, grid, warmup, **kwargs):
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            report.failure = (self.fn.__name__, " ".join((str(e) + cause).split())[-600:])
            raise
        name = self.fn.__name__
        report.launches += 1
        report.kernels[name] = report.kernels.get(name, 0) + 1
        if usage and id(kernel) not in measured:
            measured.add(id(kernel))
            report.note_usage(name, *resources(kernel.asm["cubin"]))
        return kernel

    JITFunction.run = compile_instead
    try:
        yield
    finally:
        JITFunction.run = launch


@contextlib.contextmanager
def _host_lane() -> Iterator[None]:
    """The lane built on host tensors, without CUDA graphs (what it does under the interpreter)."""
    os.environ[INTERPRET] = "1"
    try:
        yield
    finally:
        os.environ.pop(INTERPRET, None)


def check(
    path: str,
    knobs: Sequence[str] = (),
    *,
    arch: int = 90,
    report: Report | None = None,
    usage: bool = False,
    seqs: int = BATCH,
) -> Report:
    """Compile every launch of the steps of the model at `path` under `knobs` for sm_`arch` (see the module);
    a kernel that does not compile raises, named in `report`."""
    from fuselane.errors import FuselaneError
    from fuselane.runtime.model import load
    from fuselane.runtime.sampling import SamplingParams

    report = report if report is not None else Report()
    with compiling(arch, report, usage=usage):
        with _host_lane():
            model = load(path, lane="cuda", ctx=CTX, knobs=list(knobs))
        vocab = model.cfg.vocab
        ids = [i % vocab for i in range(5, 5 + WIDE_PROMPT)]
        model.session().feed(ids)
        report.steps.append("a wide chunk")
        sampled = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=1)
        narrow = ids[:NARROW_PROMPT]
        list(model.generate_ids(model.session(), narrow, max_tokens=DECODE_TOKENS, sampling=sampled))
        report.steps.append("a narrow chunk and sampled decode steps")
        try:
            settings = [sampled, SamplingParams(temperature=0)] * seqs
            model.generate_batch(["ab"] * seqs, max_tokens=2, sampling=settings[:seqs])
            report.steps.append(f"a batch of {seqs}")
        except FuselaneError as e:  # a model the batch form does not take (a recurrent state is one sequence's)
            report.steps.append(f"no batch: {e}")
    return report


def _shape(a: argparse.Namespace):
    """The synthetic shape named, cut to `--layers` and `--vocab` where given."""
    from dataclasses import replace

    from fuselane.gguf.synth import SHAPES

    shape = SHAPES.get(a.model)
    if shape is None:
        return a.model  # `write_synthetic` names the shapes it knows
    cuts = {"n_layers": a.layers, "vocab": a.vocab, "experts": a.experts}
    return replace(shape, **{k: v for k, v in cuts.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuselane.lanes.cuda.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .gguf path or a synthetic shape name (written to a temporary file)")
    ap.add_argument("--knob", action="append", default=[], metavar="K=V", help="a cuda lane knob (repeatable)")
    ap.add_argument("--mix", default="q8_0", help="the quantization mix of a synthetic shape (default q8_0)")
    ap.add_argument("--layers", type=int, default=None, help="a synthetic shape's layers (default: its own)")
    ap.add_argument("--vocab", type=int, default=None, help="a synthetic shape's vocabulary (default: its own)")
    ap.add_argument("--experts", type=int, default=None, help="a synthetic mixture's experts (default: its own)")
    ap.add_argument("--arch", type=int, default=90, help="the compute capability, e.g. 90 for an H200 (default)")
    ap.add_argument("--usage", action="store_true", help="each kernel's registers and spills, from its cubin")
    ap.add_argument("--seqs", type=int, default=BATCH, help=f"sequences of the batch step (default {BATCH})")
    a = ap.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:  # a synthetic file goes with it
        path = a.model
        if not os.path.exists(path):
            from fuselane.gguf.synth import write_synthetic

            path = str(write_synthetic(os.path.join(folder, "m.gguf"), _shape(a), a.mix, seed=1))
        report = Report()
        try:
            check(path, a.knob, arch=a.arch, report=report, usage=a.usage, seqs=a.seqs)
        except Exception as e:  # the report names a kernel that failed; anything else is the step's own error
            print(report.render(), file=sys.stderr)
            if report.failure is None:
                print(f"compile_check: {type(e).__name__}: {' '.join(str(e).split())[:600]}", file=sys.stderr)
            return 1
    print(report.render())
    print(f"({time.monotonic() - started:.1f} s)")
    return 0 if report.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
