"""A loaded model: checkpoint, tokenizer, chat template and a lane, with generation on top.

`fuselane.load(path)` is the Python entry point: it opens and checks the GGUF, recognizes the architecture,
builds the tokenizer and chat template from the file, and picks a lane. `Model.stream` yields text as it is
generated; `Model.chat` keeps a conversation and its KV cache between turns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fuselane.errors import FuselaneError, ModelError
from fuselane.gguf.reader import GgufFile, open_gguf
from fuselane.models import ModelConfig, config_of
from fuselane.runtime.sampling import GREEDY, SamplingParams
from fuselane.runtime.session import Session
from fuselane.text.chat import ChatTemplate, encode_chat
from fuselane.text.tokenizer import Tokenizer

DEFAULT_CTX = 4096  # cache rows when the caller does not ask; the model's own context is often far larger
LANES = ("cpu", "cuda", "auto")


def _cuda_available() -> bool:
    """Whether an NVIDIA driver is present, asked without importing torch on machines that have none."""
    return os.path.exists("/dev/nvidiactl")


def make_lane(
    name: str,
    cfg: ModelConfig,
    tensors: Any,
    ctx: int,
    dtype: Any,
    held: Sequence[str] = (),
    knobs: Sequence[str] = (),
):
    """The lane called `name` (`auto`: cuda when a GPU is there and the lane exists, else cpu), with the
    optimizer's rules named in `held` held back (to trace a result to one fusion, or to compare) and the cuda
    lane's `knobs` (`key=value` strings; checked on any lane, used by the cuda lane)."""
    if name not in LANES:
        raise FuselaneError(f"unknown lane '{name}' (choose from {', '.join(LANES)})")
    if knobs:
        from fuselane.lanes.cuda.plan.knobs import CudaKnobs

        parsed = CudaKnobs.parse(knobs)
        if name == "cpu":
            raise FuselaneError("knobs are the cuda lane's; the cpu lane takes none")
    else:
        parsed = None
    if name == "cuda" or (name == "auto" and _cuda_available()):
        from fuselane.lanes.cuda import CudaLane

        try:
            _cuda_runs(cfg, tensors, ctx, parsed)
            return CudaLane(cfg, tensors, ctx=ctx, held=tuple(held), knobs=parsed)
        except FuselaneError:
            if name == "cuda":
                raise  # asked for by name: say why it cannot run; `auto` falls back to the cpu lane
    from fuselane.lanes.cpu.lane import CpuLane

    return CpuLane(cfg, tensors, ctx=ctx, dtype=dtype, held=tuple(held))


def _cuda_runs(cfg: ModelConfig, tensors: Any, ctx: int, knobs: Any) -> None:
    """Refuse, by the cuda shim's reason, a model whose primitives the cuda lane has no kernels for (a mixture's
    routing) or whose matrices it decodes nowhere (a format no kernel of the lane has), before torch or a GPU is
    asked for: the plan side alone decides it."""
    from fuselane.fuse.optimizer import check_runs
    from fuselane.graph.ir import Form
    from fuselane.lanes.cuda.plan.fits import undecoded
    from fuselane.lanes.cuda.plan.knobs import CudaKnobs
    from fuselane.lanes.cuda.plan.shim import CudaShim
    from fuselane.models import recognizer

    graph = recognizer(cfg).recognize(cfg, tensors, Form.DECODE, rows=1, ctx=ctx)
    shim = CudaShim(knobs or CudaKnobs())
    check_runs(graph, shim)
    why = undecoded(graph)
    if why is not None:
        raise FuselaneError(f"the {shim.name} lane cannot run this model: {why}")


@dataclass(slots=True)
class Model:
    """A checkpoint ready to generate from."""

    path: Path
    file: GgufFile
    cfg: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate | str  # the template, or why the file has none usable
    lane: Any

    @property
    def ctx(self) -> int:
        return self.lane.ctx

    @property
    def max_prompt_bytes(self) -> int:
        """Bytes of text past which a prompt cannot fit the context, whatever it tokenizes to (a reader of
        stdin need not read further)."""
        return self.ctx * self.tokenizer.max_token_bytes

    def session(self) -> Session:
        return Session(self.lane)

    def prompt_ids(self, prompt: str, *, raw: bool = False, system: str | None = None) -> list[int]:
        """A prompt's tokens: as one user turn through the chat template, or (`raw`) the text as is, where
        special tokens written out are parsed, as a completion prompt expects.

        A prompt longer than the context is refused (`PromptTooLong`) before it is tokenized whole, and text
        that is not valid UTF-8 with one line (`FuselaneError`).
        """
        if raw:
            prefix = [self.tokenizer.bos_id] if self.tokenizer.add_bos and self.tokenizer.bos_id is not None else []
            return prefix + self.tokenizer.encode(prompt, special=True, limit=self.ctx)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.encode_messages(messages)

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation's tokens through the chat template, bounded by the context as `prompt_ids` is."""
        if isinstance(self.template, str):
            raise FuselaneError(f"{self.path.name}: {self.template}")
        return encode_chat(self.tokenizer, self.template, list(messages), limit=self.ctx)

    def generate_ids(
        self, session: Session, ids: Sequence[int], *, max_tokens: int, sampling: SamplingParams = GREEDY
    ) -> Iterator[int]:
        """Feed `ids` and yield sampled tokens until a stop token, `max_tokens`, or the context's end.

        The tokens come from the lane's decode loop (on the cuda lane: sampled on the device, no logits copied
        to the host). `session.tokens` grows by exactly the tokens fed: `ids`, then each yielded token once
        the one after it is asked for (never the last one yielded, nor a stop token).
        """
        if max_tokens < 0:  # range() would quietly make it an empty reply
            raise FuselaneError(f"the number of tokens to generate must be >= 0, not {max_tokens}")
        if len(ids) >= session.ctx:
            raise FuselaneError(
                f"the prompt is {len(ids)} tokens, which leaves no room in the context of {session.ctx} "
                "(raise --ctx or shorten the prompt)"
            )
        if max_tokens == 0:
            session.feed(ids)  # nothing to sample, but the session holds the prompt, as after any reply
            return
        pos, last = session.prepare(ids), int(ids[-1])
        # the lane's decode loop feeds the prompt's last token, then each token it yields when asked for the next
        steps = self.lane.decode(last, pos, sampling)
        session.tokens.append(last)
        try:
            for n, token in enumerate(steps, start=1):
                if token in self.tokenizer.stop_ids:
                    return
                yield token
                if n == max_tokens or session.room() == 0:
                    return
                session.tokens.append(token)
        finally:
            steps.close()

    def stream(
        self, prompt: str, *, max_tokens: int = 256, sampling: SamplingParams = GREEDY, raw: bool = False
    ) -> Iterator[str]:
        """Yield the reply's text as it is generated, always in whole UTF-8 characters."""
        decoder = self.tokenizer.stream()
        for token in self.generate_ids(
            self.session(), self.prompt_ids(prompt, raw=raw), max_tokens=max_tokens, sampling=sampling
        ):
            if piece := decoder.push(token):
                yield piece
        if tail := decoder.flush():
            yield tail

    def generate(self, prompt: str, **kwargs: Any) -> str:
        """The whole reply as one string (see `stream`)."""
        return "".join(self.stream(prompt, **kwargs))

    def generate_batch(
        self,
        prompts: Sequence[str],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        raw: bool = False,
        stop: Sequence[str] = (),
        max_seqs: int | None = None,
        ignore_eos: bool = False,
    ) -> list[str]:
        """The reply to each prompt, the prompts run together (continuous batching over a paged KV cache, at most
        `max_seqs` at a time, default all). `sampling` is one setting for all or one per prompt (each draws
        from its own generator: a seeded prompt gives the text it gives alone); a reply ends at a stop token
        (unless `ignore_eos`), a string of `stop`, `max_tokens` or the context's end. The model's sessions keep
        their caches."""
        from fuselane.engine.batch import generate_batch

        return generate_batch(
            self,
            prompts,
            max_tokens=max_tokens,
            sampling=sampling,
            raw=raw,
            stop=stop,
            max_seqs=max_seqs,
            ignore_eos=ignore_eos,
        )

    def chat(self, system: str | None = None) -> Chat:
        """A multi-turn conversation that keeps its KV cache between turns."""
        return Chat(self, self.session(), [{"role": "system", "content": system}] if system else [])

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits after every token of `ids`, from position 0 (for checks against other implementations)."""
        return self.lane.forward(np.asarray(ids), 0, all_logits=True)

    def close(self) -> None:
        self.file.close()


@dataclass(slots=True)
class Chat:
    """A conversation: each `say` renders the whole history, reusing the cache for what is unchanged."""

    model: Model
    session: Session
    messages: list[dict[str, str]] = field(default_factory=list)
    generated: int = 0  # tokens the last turn's reply took, so a caller can tell that a limit cut it

    def say(self, text: str, *, max_tokens: int = 512, sampling: SamplingParams = GREEDY) -> Iterator[str]:
        self.messages.append({"role": "user", "content": text})
        decoder = self.model.tokenizer.stream()
        reply: list[str] = []
        self.generated = 0
        try:
            # a turn the template refuses, or past the context, leaves the conversation as it was
            ids = self.model.encode_messages(self.messages)
            for token in self.model.generate_ids(self.session, ids, max_tokens=max_tokens, sampling=sampling):
                self.generated += 1
                if piece := decoder.push(token):
                    reply.append(piece)
                    yield piece
            if tail := decoder.flush():
                reply.append(tail)
                yield tail
        except FuselaneError:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(reply)})


def load(
    model: str | os.PathLike | None = None,
    *,
    lane: str = "auto",
    ctx: int | None = None,
    dtype: Any = np.float32,
    held: Sequence[str] = (),
    knobs: Sequence[str] = (),
    tp: int = 1,
) -> Model:
    """Open a checkpoint (a path, or a known name pulled on demand) and make it ready to generate.

    `ctx` is the number of cache rows (default: the model's context, at most 4096); `dtype` is the cpu lane's
    arithmetic (np.float64 for reference runs); `held` names optimizer rules the lane holds back; `knobs` are
    the cuda lane's (`["prefill=in-place"]`, see `CudaKnobs`). `tp` splits the model over that many GPUs
    (docs/parallel.md: the split is checked, and no lane runs one yet).
    """
    from fuselane.hub import resolve

    path = resolve(None if model is None else str(model))
    file = open_gguf(path)
    try:
        cfg = config_of(file.metadata, file.tensors)
        tokenizer = Tokenizer.from_metadata(file.metadata)
        if tokenizer.vocab_size > cfg.vocab:
            raise ModelError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight only {cfg.vocab} rows"
            )
        template: ChatTemplate | str
        try:
            template = ChatTemplate.from_metadata(file.metadata)
        except FuselaneError as e:  # kept, so that plain completion still works without a usable template
            template = str(e)
        if tp != 1:
            from fuselane.parallel.runtime import refuse_split

            on_gpu = lane == "cuda" or (lane == "auto" and _cuda_available())
            refuse_split(cfg, file.tensors, tp, "cuda" if on_gpu else lane)
        rows = ctx if ctx is not None else min(cfg.context, DEFAULT_CTX)
        if not 1 <= rows <= cfg.context:  # past its trained context a model's positions mean nothing
            raise FuselaneError(f"the context (--ctx) must be 1 to {cfg.context:,} tokens, the model's, not {rows:,}")
        return Model(path, file, cfg, tokenizer, template, make_lane(lane, cfg, file.tensors, rows, dtype, held, knobs))
    except BaseException:
        file.close()
        raise
