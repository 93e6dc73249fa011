"""The cuda lane: the plan the cuda shim accepts, run as Triton launches over buffers allocated once, a decode
step (and a prefill chunk of a row count seen before) captured as a CUDA graph and replayed at every position.

Weights stay in the checkpoint's own bytes on the device, in one buffer (the GEMVs decode them in the kernel);
vectors (norm weights, biases) are uploaded as f32. Every activation of a plan has its span of one arena,
allocated once a step and shared with the activations whose lives do not overlap its own (`buffers`); the
token ids and the position are device values, written from the host before a `forward` run and by the device
sampler in the decode loop (`decode`, `fuselane.lanes.cuda.run.decode`), whose graphs end with the sampler's launches.
Products of more rows than the GEMV takes (prefill chunks) decode each matrix into one f16 scratch before
cuBLAS multiplies it (`prefill=f16-scratch`, what `auto` takes for a sequence's prompt); `prefill=f16-copy`
keeps dequantized f16 copies, made on first use; `prefill=int8` multiplies the activation's int8 form by the
checkpoint's bytes on the int8 tensor cores (`triton/gemm_q8.py`), and `prefill=in-place` decodes the weights
to f16 in the kernel (`triton/gemm.py`), neither making a copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from fuselane.errors import FuselaneError
from fuselane.fuse.optimizer import Plan, optimize
from fuselane.gguf.dequant import dequantize
from fuselane.gguf.formats import Format
from fuselane.graph.ir import Form, QuantFormat, QuantizedActs, Role, TensorGraph
from fuselane.lanes.cuda.plan.kernels import QBLOCK
from fuselane.lanes.cuda.plan.knobs import (
    CachePrecision,
    CudaKnobs,
    LatentDecode,
    PrefillWeights,
    RoundInPlace,
    StatePrecision,
)
from fuselane.lanes.cuda.plan.shim import CudaShim
from fuselane.lanes.cuda.run import decode as loop
from fuselane.lanes.cuda.run import stored, workspace
from fuselane.lanes.cuda.run.buffers import F16_BYTES, delta_rule_states, dying_reads, parts, pooled_buffers
from fuselane.lanes.cuda.run.decode import DeviceSampler, Tail
from fuselane.models import ModelConfig, recognizer
from fuselane.models.qwen import IDS, LOGITS, POS
from fuselane.runtime.sampling import GREEDY, SamplingParams

WARMUP_RUNS = 2  # runs before capture: Triton compiles each kernel on its first launch
PDL_MAJOR = 9  # the compute capability (major) from which a kernel may launch as a dependent (Hopper)
ARENA_GROWTH = 2  # a replaced activation arena's least size, in its old size: the old ones sum to less than it


class CudaLane:
    """One sequence's decode steps and prefill chunks on one GPU."""

    name = "cuda"

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, Any],
        *,
        ctx: int,
        knobs: CudaKnobs | None = None,
        held: tuple[str, ...] = (),
        graphs: bool = True,
    ) -> None:
        try:
            import torch
        except ImportError:
            raise FuselaneError("the cuda lane needs torch with CUDA: pip install 'fuselane[cuda]'") from None
        # Under Triton's interpreter the lane runs its kernels on the host: how CI checks every launch of a plan
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if not interpreted and not torch.cuda.is_available():
            raise FuselaneError("the cuda lane needs an NVIDIA GPU, and torch sees none")
        self.torch, self.device = torch, torch.device("cpu" if interpreted else "cuda")
        graphs = graphs and not interpreted
        self.cfg, self.tensors, self.ctx = cfg, tensors, ctx
        knobs = knobs or CudaKnobs()
        if not interpreted:  # chip facts read from the device, not assumed
            props = torch.cuda.get_device_properties(self.device)
            smem = getattr(props, "shared_memory_per_block_optin", 0) // 1024 or knobs.chip.smem_kib_per_block
            chip = replace(knobs.chip, name=props.name, sms=props.multi_processor_count, smem_kib_per_block=smem)
            knobs = replace(knobs, chip=chip)
        # a batch of sequences (the paged form) multiplies every decode step past the GEMV's rows as a chunk
        gpu = None if interpreted else torch
        self.batch_prefill = prefill_for(knobs, cfg, tensors, ctx, gpu, batch=True)
        knobs = replace(knobs, prefill_weights=prefill_for(knobs, cfg, tensors, ctx, gpu))
        self.shim = CudaShim(knobs, held=held)
        # programmatic dependent launch needs compute capability 9.0; the interpreter runs launches in turn
        self.dependent_launch = (
            self.shim.dependent_launches(self.dense_formats())
            and not interpreted
            and torch.cuda.get_device_capability(self.device)[0] >= PDL_MAJOR
        )
        self.held, self.use_graphs = held, graphs
        self.cache_dtype = torch.float16 if knobs.cache_precision is CachePrecision.F16 else torch.float32
        self.raw: dict[str, tuple[Any, Any]] = {}
        self.vec: dict[str, Any] = {}
        self._dense: dict[str, Any] = {}
        self._scratch: Any = None  # `f16_scratch`
        self.workspace: workspace.Workspace | None = None  # how the scratch was sized (`run/workspace`)
        # `capture_stream`: made with the lane, so its siblings (shallow copies) share it; none where no graph is
        self._capture_stream = torch.cuda.Stream(self.device) if graphs else None
        self._upload()
        self.caches: dict[str, Any] = {}
        self.states: dict[str, Any] = {}  # a hybrid model's recurrent states, the sequence's (zeroed at position 0)
        self._fed = 0  # positions the recurrent states have summed
        self.state_dtype = torch.bfloat16 if knobs.recurrent_state is StatePrecision.BF16 else torch.float32
        self._steps: dict[tuple[int, bool], _Step] = {}
        self._arena: Any = None  # `activation_arena`
        self._outputs: dict[tuple[str, tuple[int, ...]], Any] = {}  # `output`
        self._sampler: DeviceSampler | None = None

    def capture_stream(self) -> Any:
        """The one stream every launch of the lane and of its siblings is made on, eager or captured. cuBLAS
        takes a workspace (32 MiB on Hopper) for each stream it runs on and keeps it while the process lives,
        so a fresh stream a capture held one more each time a step was captured, and eager runs on the
        caller's stream one more beside it."""
        return self._capture_stream

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """The lane's launches are made inside: on its one stream (`capture_stream`; after the caller's
        stream's work, which waits for them in turn), each a dependent of the last where the lane launches so
        (`pdl`), the int8 GEMVs loading their weights as the `weight_loads` knob says (`gemv/weight_loads.py`)."""
        from fuselane.lanes.cuda.triton import pdl
        from fuselane.lanes.cuda.triton.gemv.weight_loads import weight_loads

        with self._on_lane_stream(), pdl.dependent_launches(self.dependent_launch):
            with weight_loads(self.shim.knobs.weight_loads):
                yield

    @contextlib.contextmanager
    def _on_lane_stream(self) -> Iterator[None]:
        """Inside, the current stream is the lane's (where it has one, and unless it is already: a capture
        runs there), ordered after what the caller's stream has queued; the caller's waits for it after."""
        stream, torch = self._capture_stream, self.torch
        caller = torch.cuda.current_stream() if stream is not None else None
        if caller is None or caller == stream:
            yield
            return
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            yield
        caller.wait_stream(stream)

    def sibling(self, prefill: PrefillWeights | None = None) -> CudaLane:
        """A lane over the same weights on the same device (nothing uploaded again, the f16 copies shared),
        with caches, steps and a sampler of its own: the paged form's prefill runs on one, so the model's
        sessions keep theirs. Its chunks read the weights as `prefill` says where given (the paged form's
        take `batch_prefill`, as its steps do)."""
        other = copy.copy(self)
        other.caches, other._steps, other._sampler, other._arena, other._outputs = {}, {}, None, None, {}
        if prefill is not None and prefill is not self.shim.knobs.prefill_weights:
            other.shim = CudaShim(replace(self.shim.knobs, prefill_weights=prefill), held=self.held)
        return other

    # ---- weights ----------------------------------------------------------------------------------------

    def _upload(self) -> None:
        """Every tensor's bytes into one device buffer (`kernels.PART_ALIGN_BYTES` apart), each name a view of its part:
        the caching allocator rounds each block it hands out, so a block a tensor took ~120 MB more than the
        file on an 8B checkpoint (254 matrices), where one buffer takes the file's bytes. A matrix's blocks are
        laid out as the kernels read them (`run/stored.py`: Q3_K's in 112 bytes, Q6_K's d's after a row's blocks),
        one matrix at a time."""
        torch = self.torch
        host: dict[str, Any] = {}
        for name, t in self.tensors.items():
            if len(t.shape) == 1:  # vectors as f32 values
                host[name] = torch.from_numpy(dequantize(t.data, t.format, t.shape, dtype=np.float32))
            else:
                with warnings.catch_warnings():  # the mapped file is read-only; the kernels only read weights
                    warnings.simplefilter("ignore", UserWarning)
                    host[name] = torch.from_numpy(np.asarray(t.data))
        sizes = {name: h.numel() * h.element_size() for name, h in host.items()}
        relaid = {name for name, t in self.tensors.items() if len(t.shape) > 1 and stored.relaid(t.format)}
        rows = {name: stored.file_row_bytes(self.tensors[name].format, tuple(self.tensors[name].shape))
                for name in relaid}  # fmt: skip
        surplus = {name: stored.surplus(self.tensors[name].format, sizes[name], rows[name]) if name in relaid else 0
                   for name in host}  # fmt: skip
        offsets, at = parts({name: n + surplus[name] for name, n in sizes.items()})
        arena = torch.empty(at, dtype=torch.uint8, device=self.device)
        self.weights_bytes, self.stored_surplus = at, sum(surplus.values())
        for name, h in host.items():
            part = arena[offsets[name] : offsets[name] + sizes[name] + surplus[name]]
            if name in relaid:  # rows of the stored blocks, as the file's rows were
                fmt = self.tensors[name].format
                part.copy_(stored.stored_tensor(fmt, h, rows[name]))
                self.raw[name] = (part.view(*h.shape[:-1], -1), self.tensors[name].format)
                continue
            part.copy_(h.contiguous().reshape(-1).view(torch.uint8))
            on_device = part.view(h.dtype).view(h.shape)
            if len(self.tensors[name].shape) == 1:
                self.vec[name] = on_device
                # a vector a product multiplies by (a shared expert's gate, one row): its f32 bytes as a matrix's
                self.raw[name] = (part, Format.F32)
            else:
                self.raw[name] = (on_device, self.tensors[name].format)

    def dense(self, name: str) -> Any:
        """A matrix dequantized to f16 on the device, for products past the GEMV's rows (made once, by a
        kernel, from the bytes already there)."""
        if name not in self._dense:
            from fuselane.lanes.cuda.triton.gemv.epilogue import dequantize as device_dequantize

            raw, fmt = self.raw[name]
            shape = self.tensors[name].shape
            n, k = (1, shape[0]) if len(shape) == 1 else shape
            out = self.torch.empty((n, k), dtype=self.torch.float16, device=self.device)
            self._dense[name] = device_dequantize(raw, fmt, n, k, out)
        return self._dense[name]

    def f16_scratch(self, plan: Plan | None = None) -> Any:
        """Under `prefill=f16-scratch`, the one f16 buffer every chunk product decodes its matrix into (made
        once, as `workspace` sizes it; `plan`, the step asking, saves planning its chunk again where it is one).
        None under the other knobs."""
        if self.shim.knobs.prefill_weights is not PrefillWeights.F16_SCRATCH:
            return None
        if self._scratch is None:
            sized = self.sized_workspace(plan)
            if sized.cublas_config is not None and self.device.type == "cuda":
                # read when torch makes the lane's stream's workspace (some versions: at the process's first product)
                os.environ.setdefault(workspace.CUBLAS_CONFIG, sized.cublas_config)
            self._scratch = self.torch.empty(sized.scratch_values, dtype=self.torch.float16, device=self.device)
        return self._scratch

    def sized_workspace(self, plan: Plan | None = None) -> workspace.Workspace:
        """How the lane's chunks hold the workspace share (`run/workspace.sized`), sized once, against the
        weights as uploaded and the lane's arena where a step made it already; `plan`, a step's, saves
        planning its rows again."""
        if self.workspace is None:
            arena = 0 if self._arena is None else self._arena.numel() * self._arena.element_size()

            def plan_at(rows: int) -> Plan:
                return plan if plan is not None and plan.graph.rows == rows else self.plan(rows)

            shapes = {n: t.shape for n, t in self.tensors.items()}
            config = os.environ.get(workspace.CUBLAS_CONFIG)
            moe, knobs = workspace.one_gpu_mixture(self.cfg), self.shim.knobs
            self.workspace = workspace.sized(
                plan_at, self.ctx, moe, shapes, self.weights_bytes, knobs, self.cfg.vocab, config, arena,
                surplus_bytes=self.stored_surplus,
            )  # fmt: skip
        return self.workspace

    def model_bytes(self) -> int:
        """What the model holds on the device beside its workspace: the weights as uploaded but for what their
        stored layout adds to the file's bytes (`stored_surplus`, counted in the workspace) and the caches and
        recurrent states made for the lane's context (the bytes the workspace's share is of)."""
        held = (*self.caches.values(), *self.states.values())
        return self.weights_bytes - self.stored_surplus + sum(t.numel() * t.element_size() for t in held)

    def _multiplied(self, name: str) -> bool:
        """Whether a step multiplies tensor `name`: every one of two or more dimensions but an embedding table
        that is only gathered (one row a token)."""
        return len(self.tensors[name].shape) > 1 and not (name == "token_embd.weight" and not self.cfg.tied)

    def dense_formats(self) -> set[Format]:
        """The formats of the matrices a step's dense products multiply (`_multiplied`, two dimensions: not a
        mixture's expert tensors or a latent attention's per-head ones, which run kernels of their own): what
        `pdl=auto` decides by."""
        return {t.format for n, t in self.tensors.items() if self._multiplied(n) and len(t.shape) == 2}

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every matrix once, but the embedding table (one row is gathered) and a
        mixture's expert tensors (only the kept experts' matrices are read: k of them a layer)."""
        total = 0
        for n, (w, _) in self.raw.items():
            if not self._multiplied(n):
                continue
            kept = self.cfg.experts_used / self.cfg.experts if len(self.tensors[n].shape) == 3 else 1
            total += int(w.numel() * kept)
        return total

    # ---- plans ------------------------------------------------------------------------------------------

    def plan(self, rows: int, *, all_logits: bool = False) -> Plan:
        form = Form.DECODE if rows == 1 else Form.PREFILL
        raw = recognizer(self.cfg).recognize(
            self.cfg, self.tensors, form, rows=rows, ctx=self.ctx, all_logits=all_logits
        )
        return optimize(raw, self.shim, held=[h for h in self.held if h != "rows_a_warp"])

    def step(self, rows: int, *, all_logits: bool = False) -> _Step:
        key = (rows, all_logits)
        if key not in self._steps:
            self._steps[key] = _Step(self, self.plan(rows, all_logits=all_logits))
        return self._steps[key]

    def activation_arena(self, values: int) -> Any:
        """The first `values` f32 values of the lane's activation arena, which each new step of the lane lays
        its activations out in (`buffers`): its steps run one at a time on its one stream and an activation
        lives inside its step, so a step's spans may hold another's dead values. One arena, not one a step: a
        step is made for each row count a prompt's last chunk has, and an arena each grew with every prompt
        length met.

        Where a step needs more than the arena holds, a fresh one of at least twice the size takes its place
        for the steps made after; the steps made before keep theirs and their captured graphs. So the arenas a
        lane holds sum to less than twice its last, which is less than twice the most a step of it needed. Not
        sized ahead from a step's values a row: a latent attention's chunk holds values that grow with the
        context, not the rows."""
        if self._arena is None or self._arena.numel() < values:
            least = 0 if self._arena is None else ARENA_GROWTH * self._arena.numel()
            self._arena = self.torch.zeros(max(values, least), dtype=self.torch.float32, device=self.device)
        return self._arena[:values]

    def output(self, name: str, shape: tuple[int, ...]) -> Any:
        """A step's output buffer (its logits), one a name and shape for all the lane's steps: they run one at a
        time on its one stream, and a step's logits are read (copied to the host by `forward`, or sampled inside
        the decode step's own graph) before the next step writes them. One a step grew with every prompt length
        a chat met (a Qwen step's f32 logits are 0.6 MB)."""
        key = (name, tuple(shape))
        if key not in self._outputs:
            self._outputs[key] = self.torch.zeros(shape, dtype=self.torch.float32, device=self.device)
        return self._outputs[key]

    def make_caches(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The caches of `shapes` not yet made, as parts of one zeroed device buffer
        (`kernels.PART_ALIGN_BYTES` apart, as the weights are): each its own block took up to ~0.9 MB more where
        the caching allocator handed a 1.1 MB cache a 2 MB block it would not split (Qwen3-0.6B, two of 56)."""
        new = {n: s for n, s in shapes.items() if n not in self.caches}
        if not new:
            return
        itemsize = self.torch.empty(0, dtype=self.cache_dtype).element_size()
        offsets, total = parts({n: math.prod(s) * itemsize for n, s in new.items()})
        buffer = self.torch.zeros(total, dtype=self.torch.uint8, device=self.device)
        for name, shape in new.items():
            part = buffer[offsets[name] : offsets[name] + math.prod(shape) * itemsize]
            self.caches[name] = part.view(self.cache_dtype).view(shape)

    def cache(self, name: str, shape: tuple[int, ...]) -> Any:
        self.make_caches({name: shape})
        return self.caches[name]

    def state(self, name: str, shape: tuple[int, ...], rule: bool) -> Any:
        """A recurrent state's buffer, kept across steps: a delta rule's (`rule`) in the `state` knob's precision,
        a convolution's (its last inputs) in f32."""
        if name not in self.states:
            dtype = self.state_dtype if rule else self.torch.float32
            self.states[name] = self.torch.zeros(shape, dtype=dtype, device=self.device)
        return self.states[name]

    @property
    def prefill_chunk(self) -> int | None:
        """The rows a session runs a prompt in, or None for the session's own: under `prefill=f16-scratch` the
        rows the workspace is sized at (`sized_workspace`: the knob `chunk_rows` or a mixture's chunk where fixed,
        else 512, or 256 on a small low-bit file); otherwise those fixed rows (`workspace.fixed_rows`)."""
        if self.shim.knobs.prefill_weights is PrefillWeights.F16_SCRATCH:  # as `prefill_for` resolved `auto`
            return self.sized_workspace().rows
        return workspace.fixed_rows(self.shim.knobs, workspace.one_gpu_mixture(self.cfg))

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps recurrent state, which sums the whole sequence: it cannot rewind to an
        earlier position, only start again at 0."""
        return self.cfg.linear is not None

    def continue_at(self, pos: int) -> None:
        """Zero the recurrent states where a sequence starts (position 0); refuse to continue them anywhere but
        where they stopped."""
        if not self.recurrent:
            return
        if pos == 0:
            for state in self.states.values():
                state.zero_()
        elif pos != self._fed:
            raise ValueError(f"the recurrent state holds {self._fed} positions; it cannot continue at {pos}")

    def fed(self, pos: int) -> None:
        """The recurrent states have summed every position before `pos`."""
        self._fed = pos

    def forward(self, ids: np.ndarray, pos: int, *, all_logits: bool = False) -> np.ndarray:
        """Run len(ids) tokens at positions pos ..; logits of the last row (or every row), on the host. Logits
        that are not finite raise `NonFinite`, naming the layer and op where the lane's numbers left the
        finite range."""
        ids = np.asarray(ids)
        if pos + len(ids) > self.ctx:
            raise ValueError(f"positions up to {pos + len(ids)} exceed the cache of {self.ctx}")
        step = self.step(len(ids), all_logits=all_logits)
        self.continue_at(pos)
        step.run(ids, pos)
        self.fed(pos + len(ids))
        logits = step.logits().float().cpu().numpy().copy()  # the buffer is rewritten by the next step
        if not np.isfinite(logits).all():  # the lane's own account: which op made it
            from fuselane.lanes.cuda.run.finite import NonFinite, explain_non_finite

            raise NonFinite(explain_non_finite(step))
        return logits

    def decode(self, token: int, pos: int, sampling: SamplingParams) -> Iterator[int]:
        """Feed `token` at `pos`, then yield the sampled next tokens one after another, each fed at the next
        position in turn, until the cache is full; the consumer stops iterating when it has what it wants.

        Each step is one replay of a captured graph that computes the logits, samples on the device (the
        sampler's token and the advanced position are the next replay's inputs) and leaves the logits
        there: the host reads eight bytes a token. The loop runs one step ahead of the tokens read, so when
        the consumer stops, the step feeding the last token read has run too and wrote one cache row past
        what the caller holds; the caller's next feed at that position overwrites it. One loop at a time: a
        new loop, or a `forward`, takes the lane from the last. See `fuselane.lanes.cuda.run.decode`.
        """
        return loop.decode(self, token, pos, sampling)

    def sampler(self) -> DeviceSampler:
        """The device sampler bound to the decode step's buffers (made on first use)."""
        if self._sampler is None:
            bufs = self.step(1).bufs
            self._sampler = DeviceSampler(self, bufs[LOGITS], bufs[IDS], bufs[POS])
        return self._sampler

    def launches_per_token(self) -> int:
        """Launches one greedy decode step makes: the plan's and the sampler's."""
        return self.step(1).launches + len(self.sampler().tail(GREEDY).launches)


def int8_form(shape: tuple[int, ...], device: Any) -> Any:
    """The int8 form (`quant.Q8Acts`) of an activation the plan writes quantized: a decode step's products
    multiply it with dp4a, a chunk's on the int8 tensor cores."""
    from fuselane.lanes.cuda.triton.quant import empty_q8

    if shape[-1] % QBLOCK:
        raise FuselaneError(f"int8 activations take rows of whole {QBLOCK}-value blocks, not {shape[-1]}")
    return empty_q8(math.prod(shape[:-1]), shape[-1], device)


# `prefill=auto`: the f16 copies where they fit in the GPU's free memory beside the file's weights and the cache,
# with a workspace of PREFILL_HEADROOM of the GPU's memory, at least PREFILL_HEADROOM_MIN_BYTES, kept for a chunk's
# activations and logits and cuBLAS's own (a 7B's 512-row chunk takes ~70 MB of activations and 311 MB of f32
# logits); else the f16 scratch, whose workspace is within 5 % of the weights and cache.
PREFILL_HEADROOM = 0.05
PREFILL_HEADROOM_MIN_BYTES = 2 * 2**30


def prefill_for(
    knobs: CudaKnobs, cfg: ModelConfig, tensors: Mapping[str, Any], ctx: int, torch: Any, *, batch: bool = False
) -> PrefillWeights:
    """The `prefill` knob as the lane runs it: any value but `auto` stays. `auto` is `f16-scratch` for one
    sequence's chunks, which decode each matrix once a chunk of up to `kernels.SCRATCH_CHUNK_ROWS` (no copy
    kept: the model takes its file, its cache and a workspace). For a `batch` of sequences, whose every decode
    step past the GEMV's rows multiplies as a chunk does, it is `f16-copy` where `copies_fit` (a step would
    otherwise decode every matrix), else `f16-scratch`. `torch` None: the host's interpreter, where the copies
    stand for a GPU with room."""
    if knobs.prefill_weights is not PrefillWeights.AUTO or not batch:
        return workspace.sequence_prefill(knobs)
    if torch is None:
        return PrefillWeights.F16_COPY
    free, total = torch.cuda.mem_get_info()
    cache = ctx * cfg.n_layers * cfg.cache_values * workspace.CACHE_BYTES[knobs.cache_precision]
    fits = copies_fit(tensors, cache, free, total)
    return PrefillWeights.F16_COPY if fits else PrefillWeights.F16_SCRATCH


def copies_fit(tensors: Mapping[str, Any], cache: int, free: int, total: int) -> bool:
    """Whether the f16 copies of the matrices (every 2-D tensor a chunk's products or gather may read) fit in
    `free` bytes beside the tensors' own bytes, `cache` bytes of cache and the workspace."""
    weights = sum(int(np.asarray(t.data).nbytes) for t in tensors.values())
    copies = sum(F16_BYTES * math.prod(t.shape) for t in tensors.values() if len(t.shape) == 2)
    headroom = max(PREFILL_HEADROOM * total, PREFILL_HEADROOM_MIN_BYTES)
    return weights + copies + cache + headroom <= free


def decodes_in_kernel(knobs: CudaKnobs) -> bool:
    """Whether the products past the GEMV's rows that the int8 GEMM does not take decode the checkpoint's bytes
    to f16 in their kernel (`prefill=in-place` or `int8`), rather than multiply f16 matrices with cuBLAS
    (copies, or decoded into a scratch a product)."""
    return not knobs.prefill_weights.cublas


def _attention_in_f16(knobs: CudaKnobs) -> bool:
    """Whether the numerics let an attention take its operands in f16 (the int8 numerics do): a chunk's on the
    f16 tensor cores, a decode step's with its groups' heads packed (`CudaShim.packs_gqa_rows`)."""
    return CudaShim(knobs).packs_gqa_rows


def _latent_packed(knobs: CudaKnobs) -> bool:
    """Whether a decode step's latent attention takes the packed f16 kernel: asked for (`latent_decode`), under
    numerics whose attention takes f16 operands."""
    return knobs.latent_decode is LatentDecode.PACKED and _attention_in_f16(knobs)


class _Step:
    """A plan bound to buffers: its launches, and (for a decode step) the CUDA graph that replays them."""

    def __init__(self, lane: CudaLane, plan: Plan) -> None:
        from fuselane.lanes.cuda.run.launch import Bound, bind

        torch = lane.torch
        self.lane, self.plan, self.torch = lane, plan, torch
        g: TensorGraph = plan.graph
        if lane.shim.activation_format is not None and lane.shim.activation_format is not QuantFormat.ONE_WORD:
            raise FuselaneError("activations=int8x2 waits for its two-word kernels; use int8 or dequant")

        def f32(shape: tuple[int, ...]) -> Any:
            return torch.zeros(shape, dtype=torch.float32, device=lane.device)

        # activations share the arena's bytes where their lives do not overlap (`buffers`): a chunk's workspace
        # is what it holds at once, not every layer's
        bufs, q8 = pooled_buffers(plan, f32, lambda shape: int8_form(shape, lane.device), lane.activation_arena)
        rules = delta_rule_states(plan)
        lane.make_caches({name: t.shape for name, t in g.tensors.items() if t.role is Role.CACHE})
        for name, t in g.tensors.items():
            if t.role is Role.CACHE:
                bufs[name] = lane.cache(name, t.shape)
            elif t.role is Role.STATE:
                bufs[name] = lane.state(name, t.shape, name in rules)
            elif t.role is Role.OUTPUT:
                bufs[name] = lane.output(name, t.shape)
                if isinstance(t.storage, QuantizedActs):  # the plan writes its int8 form
                    q8[name] = int8_form(t.shape, lane.device)
        bufs[IDS] = torch.zeros(g.rows, dtype=torch.int32, device=lane.device)
        bufs[POS] = torch.zeros(1, dtype=torch.int32, device=lane.device)
        self.bufs, self.q8 = bufs, q8  # the int8 forms too: a test reads what a launch wrote there
        in_place = decodes_in_kernel(lane.shim.knobs)
        scratch = lane.f16_scratch(plan)  # sizes the lane's workspace on its first chunk
        rounding = lane.shim.knobs.round_in_place
        sized = lane.workspace is not None and lane.workspace.rounds_in_place
        rounds = rounding is RoundInPlace.ON or (rounding is RoundInPlace.AUTO and sized)
        self.rounds_in_place = rounds  # a chunk's products round their dying activations in their own bytes
        bound = Bound(
            g, bufs, lane.raw, lane.vec, lane.dense,
            in_place=in_place, q8=q8, attention_f16=_attention_in_f16(lane.shim.knobs), sms=lane.shim.knobs.chip.sms,
            latent_packed=_latent_packed(lane.shim.knobs),
            delta_products=lane.shim.knobs.delta_products.value, f16_scratch=scratch,
            dying=dying_reads(plan) if rounds else frozenset(),
        )  # fmt: skip
        # each op of the plan and its launches (one, none for a view): what `fuselane explain` counts
        self.bound = [(op, bind(op, bound)) for op in plan.ops]
        self.launch_list = [launch for _, launches in self.bound for launch in launches]
        self.launches = len(self.launch_list)
        self.graphs: dict[Hashable, Any] = {}  # the captured step, by its sampler tail's key (None: no tail)
        self.runs: dict[Hashable, int] = {}

    def eager(self, tail: Tail | None = None) -> None:
        """Launch the step (and its tail) one launch at a time, each a dependent of the last where the lane
        launches so."""
        with self.lane.launching():
            for launch in self.launch_list:
                launch()
            for launch in tail.launches if tail is not None else ():
                launch()

    def feed(self, token: int, pos: int) -> None:
        """Write a decode step's input token and position from the host."""
        self.bufs[IDS].fill_(token)
        self.bufs[POS].fill_(pos)

    def run(self, ids: np.ndarray, pos: int) -> None:
        """Run the step on `ids` at `pos` (host values), leaving its logits on the device."""
        torch = self.torch
        self.bufs[IDS].copy_(torch.from_numpy(np.asarray(ids, dtype=np.int32)), non_blocking=True)
        self.bufs[POS].fill_(pos)
        self.launch()

    def launch(self, tail: Tail | None = None) -> None:
        """Run the step on the inputs already on the device, with `tail`'s launches after it: eagerly for its
        first runs (Triton compiles each kernel on its first launch), then as a graph captured once per tail
        and replayed: a decode step, and a prefill chunk of a row count met before (its hundreds of launches
        cost the host more than the GPU takes to run them)."""
        key = tail.key if tail is not None else None
        graph = self.graphs.get(key)
        if graph is None and self.lane.use_graphs:
            if self.runs.get(key, 0) >= WARMUP_RUNS:
                graph = self.capture(key, tail)
        if graph is not None:
            graph.replay()
            return
        self.eager(tail)
        self.runs[key] = self.runs.get(key, 0) + 1

    def capture(self, key: Hashable, tail: Tail | None) -> Any:
        """Record the step's launches and `tail`'s once; later steps replay them (their inputs are device
        values). A run on the capture stream comes first, as torch advises; it advances what the tail
        advances (the input id, the position, the draw counter), which is put back before capturing."""
        torch = self.torch
        torch.cuda.synchronize()
        # the warm-up run also moves the recurrent states on a step: put back with the tail's values
        state = (*(tail.state if tail is not None else ()), *self.lane.states.values())
        saved = [t.clone() for t in state]
        graph = torch.cuda.CUDAGraph()
        self.eager(tail)  # on the lane's stream (`launching`), the one the graph is captured on
        for t, value in zip(state, saved, strict=True):
            t.copy_(value)  # on the caller's stream, which waits for the run
        with torch.cuda.graph(graph, stream=self.lane.capture_stream()):
            self.eager(tail)
        self.graphs[key] = graph
        return graph

    def logits(self) -> Any:
        return self.bufs[LOGITS]
