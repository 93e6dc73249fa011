"""The cpu lane: runs a model's graphs with NumPy over weights dequantized once, and holds the KV cache.

Matrices are dequantized on first use into the lane's dtype (f32, or f64 for reference runs) and kept; the
embedding table stays quantized in the mapped file and only the gathered rows are dequantized, unless the
output projection shares it. A mixture's expert tensors stay quantized too: each product dequantizes only
the matrices of the experts its rows route to, when they do, and keeps none. Peak memory is one dequantized
copy of the other weights plus the mapped file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fuselane.fuse.optimizer import Plan, optimize
from fuselane.gguf.dequant import dequantize, dequantize_rows
from fuselane.graph import facts
from fuselane.graph.ir import Form, Fused, Op, Role, Strided, TensorGraph
from fuselane.graph.ops import ExpertMatmul, SetRow
from fuselane.lanes.cpu.kernels import GATHER, KERNELS
from fuselane.lanes.cpu.moe_kernels import expert_products
from fuselane.lanes.cpu.shim import CpuShim
from fuselane.models import ModelConfig, recognizer
from fuselane.models.qwen import IDS, LOGITS, POS
from fuselane.runtime.sampling import Sampler, SamplingParams

EXPERT_DIMS = 3  # an expert tensor: (experts, rows, row length)


class CpuLane:
    """Executes decode steps and prefill chunks of one model, one sequence, on the host."""

    name = "cpu"

    def __init__(
        self, cfg: ModelConfig, tensors: Mapping[str, Any], *, ctx: int, dtype: Any = np.float32, held=()
    ) -> None:
        self.cfg, self.tensors, self.ctx = cfg, tensors, ctx
        self.dtype = np.dtype(dtype)
        self.shim = CpuShim(self.dtype, tuple(held))
        self._weights: dict[str, np.ndarray] = {}
        self._graphs: dict[tuple[int, bool | str], TensorGraph] = {}
        self._cache: dict[str, np.ndarray] = {}
        self._fed = 0  # positions the recurrent states have summed (a hybrid model's)
        self._liveness: dict[int, tuple[TensorGraph, list[tuple[str, ...]]]] = {}

    def graph(self, rows: int, *, all_logits: bool = False) -> TensorGraph:
        """The fused graph for `rows` rows (a decode step when one), built once per shape."""
        key = (rows, all_logits)
        if key not in self._graphs:
            self._graphs[key] = self.plan(rows, all_logits=all_logits).graph
        return self._graphs[key]

    def plan(self, rows: int, *, all_logits: bool = False) -> Plan:
        """The fused plan of `rows` rows on this lane (with the lane's held rules held back)."""
        form = Form.DECODE if rows == 1 else Form.PREFILL
        raw = recognizer(self.cfg).recognize(
            self.cfg, self.tensors, form, rows=rows, ctx=self.ctx, all_logits=all_logits
        )
        return optimize(raw, self.shim, held=self.shim.held)

    def sibling(self) -> CpuLane:
        """A lane over the same weights and graphs with a KV cache of its own: runs on it leave this lane's
        cache, and the sessions over it, as they were."""
        twin = CpuLane(self.cfg, self.tensors, ctx=self.ctx, dtype=self.dtype, held=self.shim.held)
        twin._weights, twin._graphs, twin._liveness = self._weights, self._graphs, self._liveness
        return twin

    def weight(self, name: str) -> np.ndarray:
        """A weight dequantized into the lane's dtype, once."""
        if name not in self._weights:
            t = self.tensors[name]
            self._weights[name] = dequantize(t.data, t.format, t.shape, dtype=self.dtype)
        return self._weights[name]

    def warm(self) -> None:
        """Dequantize every weight the graphs read now, rather than on the first step."""
        for name, tensor in self.graph(1).tensors.items():
            gathered = name == "token_embd.weight" and not self.cfg.tied
            if tensor.role is Role.WEIGHT and not gathered and len(tensor.shape) < EXPERT_DIMS:
                self.weight(name)

    def dequantized_bytes(self) -> int:
        """Bytes the lane holds in dequantized weights."""
        return sum(w.nbytes for w in self._weights.values())

    def cache(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = np.zeros(shape, dtype=self.dtype)
        return self._cache[name]

    def forward_batch(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One step of len(ids) sequences, sequence i's token ids[i] at positions[i] of its own cache block
        (the lane holds `ctx` rows a sequence); logits of every sequence."""
        ids, positions = np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        if positions.max(initial=0) >= self.ctx:
            raise ValueError(f"a position passes the cache of {self.ctx}")
        key = (len(ids), "batch")
        if key not in self._graphs:
            raw = recognizer(self.cfg).recognize(self.cfg, self.tensors, Form.BATCH, rows=len(ids), ctx=self.ctx)
            self._graphs[key] = optimize(raw, self.shim, held=self.shim.held).graph
        return self.run(self._graphs[key], ids, positions)

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps recurrent state, which sums the whole sequence: it cannot rewind to an
        earlier position, only start again at 0."""
        return self.cfg.linear is not None

    def forward(self, ids: np.ndarray, pos: int, *, all_logits: bool = False) -> np.ndarray:
        """Run `len(ids)` tokens at positions pos .. pos + len - 1; logits of the last row (or every row).

        A recurrent model's states start again at position 0 and otherwise must continue where they are."""
        ids = np.asarray(ids, dtype=np.int64)
        if pos + len(ids) > self.ctx:
            raise ValueError(f"positions up to {pos + len(ids)} exceed the cache of {self.ctx}")
        if self.recurrent:
            self._continue_at(pos)
        logits = self.run(self.graph(len(ids), all_logits=all_logits), ids, pos)
        self._fed = pos + len(ids)
        return logits

    def _continue_at(self, pos: int) -> None:
        if pos == 0:
            for name in [n for n in self._cache if n in self._states()]:
                self._cache[name][...] = 0
        elif pos != self._fed:
            raise ValueError(f"the recurrent state holds {self._fed} positions; it cannot continue at {pos}")

    def _states(self) -> set[str]:
        return {n for n, t in self.graph(1).tensors.items() if t.role is Role.STATE}

    def decode(self, token: int, pos: int, sampling: SamplingParams) -> Iterator[int]:
        """Feed `token` at `pos`, then yield the sampled next tokens one after another, each fed at the next
        position in turn, until the cache is full (the cuda lane's decode loop, on the host: the logits are
        here already, and the host `Sampler` picks). A token is fed only when the next one is asked for."""
        if not 0 <= pos < self.ctx:
            raise ValueError(f"position {pos} is outside the cache of {self.ctx}")
        return self._decode(token, pos, Sampler(sampling))

    def _decode(self, token: int, pos: int, sampler: Sampler) -> Iterator[int]:
        while True:
            token = sampler(self.forward(np.array([token]), pos)[-1])
            yield token
            pos += 1
            if pos >= self.ctx:
                return

    def run(self, g: TensorGraph, ids: np.ndarray, pos: int) -> np.ndarray:
        env: dict[str, np.ndarray] = {IDS: ids, POS: np.asarray(pos)}
        for op, dead in zip(g.ops, self._dead_after(g), strict=True):
            self._step(g, op, env, pos)
            for name in dead:  # a chunk's activations would otherwise all stay alive until it ends
                del env[name]
        return env[LOGITS]

    def _dead_after(self, g: TensorGraph) -> list[tuple[str, ...]]:
        """For each op, the activations no later op reads, so they can be freed once it has run."""
        cached = self._liveness.get(id(g))
        if cached is not None and cached[0] is g:  # the same graph object, not one that reused its id
            return cached[1]
        last: dict[str, int] = {}
        for i, op in enumerate(g.ops):
            for name in (*facts.reads(op), *facts.writes(op)):
                if g.tensors[name].role is Role.ACTIVATION:
                    last[name] = i
        dead: list[list[str]] = [[] for _ in g.ops]
        for name, i in last.items():
            dead[i].append(name)
        result = [tuple(d) for d in dead]
        self._liveness[id(g)] = (g, result)
        return result

    def _value(self, g: TensorGraph, name: str, env: dict[str, np.ndarray]) -> np.ndarray:
        if name in env:
            return env[name]
        tensor = g.tensors[name]
        if tensor.role is Role.WEIGHT:
            return self.weight(name)
        if tensor.role in (Role.CACHE, Role.STATE):
            return self.cache(name, tensor.shape)
        raise KeyError(f"{name} is read before it is written")

    def _step(self, g: TensorGraph, op: Op, env: dict[str, np.ndarray], pos: int) -> None:
        if isinstance(op.sym, Fused):
            # A fused op runs its parts' kernels in order in one call: the same numbers as the parts apart,
            # its intermediates freed with it (they die with the op in the liveness table).
            for part in op.sym.parts:
                self._step(g, part, env, pos)
            return
        spec = op.prim()
        if isinstance(spec, ExpertMatmul):
            x, w, *route = op.ins
            result = expert_products(spec, env[x], self.tensors[w], [env[n] for n in route], self.dtype)
        elif isinstance(spec, GATHER):
            table, ids = op.ins
            if table in self._weights:
                result = self._weights[table][env[ids]]
            else:
                t = self.tensors[table]
                result = dequantize_rows(t.data, t.format, t.shape, env[ids], dtype=self.dtype)
        else:
            args = [self._view(self._value(g, n, env), a) for n, a in zip(op.ins, op.access, strict=True)]
            result = KERNELS[type(spec)](spec, args, pos)
        self._write(g, op, result, env, pos)

    @staticmethod
    def _view(x: np.ndarray, access: Any) -> np.ndarray:
        if isinstance(access, Strided):
            return x.reshape(-1, access.pitch)[:, access.offset : access.offset + access.width]
        return x

    def _write(self, g: TensorGraph, op: Op, result: np.ndarray, env: dict[str, np.ndarray], pos: int) -> None:
        dst = op.dst
        if dst.own() is not None and g.tensors[dst.buf].role is Role.STATE:  # kept in place, across steps
            state = self._value(g, dst.buf, env)
            state[...] = result.reshape(state.shape)
            env[dst.buf] = state
            return
        if dst.own() is not None:
            env[dst.buf] = result
            return
        target = self._value(g, dst.buf, env)
        if dst.row is not None:
            rows = target.reshape(-1, dst.row.pitch)
            values = result.reshape(-1, dst.row.pitch)
            spec = op.sym
            if isinstance(spec, SetRow) and spec.batched:  # row i lands in sequence i's block of the table
                rows[np.arange(spec.rows) * spec.seq_rows + np.asarray(pos)] = values
            else:
                start = pos if isinstance(dst.row.sel, str) else dst.row.sel
                rows[start : start + values.shape[0]] = values
        if dst.unit is not None:
            u = dst.unit
            target.reshape(-1, u.pitch)[:, u.offset : u.offset + u.width] = result.reshape(-1, u.width)
        env[dst.buf] = target
