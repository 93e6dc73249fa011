"""Run a model's ranks as CPU processes, one a rank, over a gloo process group (torchrun's layout: each
process a rank of one group), and hand back the logits every rank computed.

This is how the rank logic is checked without GPUs: each process opens the checkpoint, takes its slices,
and runs its graph (`executor.RankLane`); the collectives go through gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

TIMEOUT_S = 120  # a rank that waits longer on the others has lost them
# fork starts a rank in a fraction of the time spawn takes (nothing to import again); the ranks run only
# NumPy and gloo, which a forked child may use
START = "fork"


def _rank_main(rank: int, tp: int, path: str, steps: list[list[int]], ctx: int, rendezvous: str, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    from fuselane.gguf.reader import open_gguf
    from fuselane.models import config_of
    from fuselane.parallel.executor import RankLane, TorchGroup

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        with open_gguf(path) as f:
            cfg = config_of(f.metadata, f.tensors)
            lane = RankLane(cfg, f.tensors, tp=tp, rank=rank, comm=TorchGroup(), ctx=ctx, dtype=np.float64)
            logits, pos = [], 0
            for ids in steps:  # each step's rows at the positions after the last's
                logits.append(lane.forward(np.array(ids), pos, all_logits=True))
                pos += len(ids)
        out.put((rank, logits))
    except BaseException as e:
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def rank_logits(path: str | Path, tp: int, steps: list[list[int]], ctx: int) -> list[list[np.ndarray]]:
    """Every rank's logits (f64, every row) of `steps` (a prefill chunk, then decode steps, ...), by rank."""
    import torch.distributed  # noqa: F401  (imported once here, so that the forked ranks need not each)

    spawn = mp.get_context(START)
    out = spawn.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            spawn.Process(target=_rank_main, args=(r, tp, str(path), steps, ctx, rendezvous, out)) for r in range(tp)
        ]
        for p in procs:
            p.start()
        try:
            results = dict(out.get(timeout=TIMEOUT_S) for _ in procs)
        except BaseException:
            for p in procs:  # a rank that lost the others would otherwise wait on them until its own timeout
                p.terminate()
            raise
        finally:
            for p in procs:
                p.join(TIMEOUT_S)
    failed = [f"rank {r}: {v}" for r, v in sorted(results.items()) if isinstance(v, str)]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [results[r] for r in range(tp)]
