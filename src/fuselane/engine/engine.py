"""The engine: the scheduler's steps run on a paged lane, fed by submissions from any thread.

A server's handlers `submit` requests and `cancel` them from the event loop; the engine's own thread takes
them in between steps, plans a step, runs it on the lane and hands each sequence's events to the sink given
with it (from the engine's thread; a sink must not block). Without the thread, `run_until_idle` steps until
every submitted sequence has ended (the Python API's batches). `stats` is a snapshot taken after each step.

The queue is bounded: past `max_seqs` running and `max_queue` waiting, `submit` raises `QueueFull`.

Overlap (where the lane's `overlap` is on: the cuda lane's, by default): a step of decode rows only is
launched and left running; the next `step` launches the step after it (`Scheduler.plan_ahead`: the same rows
one on, its inputs made on the device from the picks) before it reads the first one's tokens, so the host's
work on them (stop checks, detokenizing, events, the next plan) runs while the GPU computes the next step, as
vLLM's async scheduling and SGLang's overlap scheduler do. Where the next step cannot be planned without the
tokens (a join, a prefill chunk, a preemption, a cancel), the step reads them first and plans as without
overlap. A row of the step planned ahead whose sequence the tokens end is dropped, never reported, and the
lane's per-sequence state is kept as if it had not run (the device sampler's draws of an ended sequence are
forgotten with it), so every sequence's tokens are those it gets without overlap.

The rows of the step planned ahead whose sequences go on are kept, not recomputed: each is the very step the
engine would run without overlap (its token the pick, its position the next). What overlap does not hide is
the step after a batch change: reading the tokens first leaves the GPU idle for the host's work once, as every
step did before, and the next step is written from the host. A steady batch (the benchmark's window, where all
B decode) pays it never; a server pays it about once a join or an end, so its gain shrinks as the batch turns
over faster. Keeping an ended sequence's row running as padding (over the spare block) until the bucket
shrinks would hide the ends too, at the price of the rows' remapping; not done yet.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from fuselane.engine.blocks import BlockPool
from fuselane.engine.lane import PagedLane, Work
from fuselane.engine.scheduler import Scheduler
from fuselane.engine.sequence import Event, Finish, Request, Sequence, Sink
from fuselane.engine.stops import StopText
from fuselane.errors import FuselaneError
from fuselane.runtime.session import DEFAULT_CHUNK
from fuselane.text.tokenizer import Tokenizer

SHUTDOWN = "the server is shutting down"


class QueueFull(FuselaneError):
    """No room for another request: `max_seqs` run and `max_queue` wait."""


@dataclass(frozen=True, slots=True)
class Stats:
    """The engine after its last step."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 0
    steps: int = 0
    generated: int = 0  # tokens sampled since the start
    preemptions: int = 0


class Engine:
    """Runs requests together on `lane` over `pool`, at most `max_seqs` at a time."""

    def __init__(
        self,
        lane: PagedLane,
        tokenizer: Tokenizer,
        pool: BlockPool,
        *,
        ctx: int,
        max_seqs: int,
        max_queue: int,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        self.lane, self.tokenizer, self.pool, self.ctx = lane, tokenizer, pool, ctx
        self.max_seqs, self.max_queue = max_seqs, max_queue
        self.scheduler = Scheduler(pool, ctx=ctx, max_seqs=max_seqs, chunk=chunk, stop_ids=tokenizer.stop_ids)
        self._cv = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: set[int] = set()
        self._sinks: dict[int, Sink] = {}
        self._live = 0  # submitted and not yet ended, wherever they are
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._steps = self._generated = 0
        self._flight: list[Work] | None = None  # the decode rows launched and not read (overlap)
        self.stats = Stats(kv_blocks_total=pool.total, block_size=pool.block_size)

    # --- from any thread ------------------------------------------------------------------------------------

    def warm(self) -> int:
        """Make the lane's steps ready before the first request (`PagedLane.warm`: every batch size up to
        `max_seqs`, every prefill chunk size); how many it made ready. Call before `start`."""
        return self.lane.warm(self.max_seqs, self.scheduler.chunk)

    def check(self, request: Request) -> None:
        """Raise a one-line FuselaneError unless `request` can run here."""
        n = len(request.prompt)
        if n == 0:
            raise FuselaneError("the prompt is empty")
        if n >= self.ctx:
            raise FuselaneError(f"the prompt is {n} tokens, which leaves no room in the context of {self.ctx} tokens")
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise FuselaneError(f"a prompt token id is outside the vocabulary of {vocab} tokens")
        if request.max_tokens is not None and request.max_tokens < 0:
            raise FuselaneError(f"max_tokens must be >= 0, not {request.max_tokens}")

    def submit(self, request: Request, sink: Sink) -> int:
        """Queue `request`; its events go to `sink`. Returns its sequence id. Raises QueueFull."""
        self.check(request)
        with self._cv:
            if self._stopping:
                raise FuselaneError(SHUTDOWN)
            if self._live >= self.max_seqs + self.max_queue:
                raise QueueFull(f"{self.max_seqs} sequences run and {self.max_queue} wait: try again later")
            seq = Sequence.start(next(self._ids), request, StopText(self.tokenizer.stream(), request.stop))
            if request.max_tokens == 0:  # nothing to generate: it ends here, as a reply of no tokens
                seq.finish = Finish.LENGTH
            else:
                self._inbox.append(seq)
                self._sinks[seq.id] = sink
                self._live += 1
                self._cv.notify()
        if seq.finish is not None:
            sink(seq.event(""))
        return seq.id

    @property
    def pending(self) -> int:
        """Requests submitted and not yet ended, queued or running."""
        with self._cv:
            return self._live

    def cancel(self, seq_id: int) -> None:
        """End a sequence (its client went away); its blocks return before the next step."""
        with self._cv:
            self._cancels.add(seq_id)
            self._cv.notify()

    def start(self) -> None:
        """Run steps in a thread of the engine's own until `stop` (again: nothing)."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fuselane-engine", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step; sequences still queued or running end with an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._intake()
        self._abandon(SHUTDOWN)

    @property
    def overlap(self) -> bool:
        """Whether decode steps overlap the host's work (the lane's `overlap`; see the module)."""
        return bool(getattr(self.lane, "overlap", False))

    def _abandon(self, message: str) -> None:
        """End every queued and running sequence with `message`."""
        if self._flight is not None:  # its tokens are never read
            self._flight = None
            self.lane.discard()
        events = []
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.end(seq, Finish.ERROR)
            events.append(seq.event("", error=message))
        self._finish(events)

    # --- the engine's thread --------------------------------------------------------------------------------

    def run_until_idle(self) -> None:
        """Step until every submitted sequence has ended (without the engine's thread)."""
        while self.step():
            pass

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._cancels or self._busy):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # a bug past the lane (a token the tokenizer cannot spell): end what runs, go on
                self._abandon(f"internal error: {type(e).__name__}: {e}")

    @property
    def _busy(self) -> bool:
        return self._flight is not None or not self.scheduler.idle

    def step(self) -> bool:
        """Take in submissions and cancels, run one step (overlapped: read the step in flight, having launched
        the one after it where it can); False when there was nothing to run."""
        events = self._intake()
        if self._flight is not None:
            events += self._land(self._flight)
            ran = True
        else:
            works = self.scheduler.plan()
            ran = bool(works)
            if works and self.overlap and all(w.samples and len(w.ids) == 1 for w in works):
                events += self._launch(works)
            elif works:
                events += self._run(works)
        self._finish(events)
        return ran or self._busy

    def _run(self, works: Seq[Work]) -> list[Event]:
        try:
            tokens = self.lane.step(works)
        except Exception as e:
            return self._failed(works, e)
        return self._apply(works, tokens)

    def _launch(self, works: list[Work]) -> list[Event]:
        """Launch a step of decode rows, its tokens read by the next `step` (`_land`)."""
        try:
            self.lane.launch(works)
        except Exception as e:
            return self._failed(works, e)
        self._flight = works
        return []

    def _land(self, flight: list[Work]) -> list[Event]:
        """Launch the step after `flight` where it can be planned ahead, then read `flight`'s tokens."""
        self._flight = None
        try:
            ahead = self.scheduler.plan_ahead(flight)
            if ahead is not None:
                self.lane.launch_next(ahead)
            tokens = self.lane.collect()
        except Exception as e:
            self.lane.discard()
            return self._failed(flight, e)
        self._flight = ahead
        return self._apply(flight, tokens)

    def _apply(self, works: Seq[Work], tokens: Seq[int | None]) -> list[Event]:
        self._steps += 1
        live = {s.id for s in self.scheduler.running}  # a row of a sequence ended meanwhile is dropped
        self._generated += sum(t is not None and w.seq in live for w, t in zip(works, tokens, strict=True))
        return self.scheduler.apply(works, tokens)

    def _failed(self, works: Seq[Work], e: Exception) -> list[Event]:
        if isinstance(e, FuselaneError):
            return self.scheduler.fail(works, str(e))
        # a lane bug must end its sequences, not the server
        return self.scheduler.fail(works, f"internal error: {type(e).__name__}: {e}")

    def _intake(self) -> list[Event]:
        with self._cv:
            fresh, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        for seq in fresh:
            self.scheduler.add(seq)
        events = []
        for seq_id in cancels:
            seq = self.scheduler.find(seq_id)
            if seq is not None:
                self.scheduler.end(seq, Finish.CANCELLED)
                events.append(seq.event(""))
        return events

    def _finish(self, events: list[Event]) -> None:
        """Publish the stats, retire the ended sequences, and deliver the events (outside the lock)."""
        ended = [e.seq for e in events if e.finish is not None]
        for seq_id in ended:
            self.lane.forget(seq_id)
        s = self.scheduler
        with self._cv:
            self._live -= len(ended)
            self.stats = Stats(
                len(s.running), len(s.waiting) + len(self._inbox), self.pool.used, self.pool.total,
                self.pool.block_size, self._steps, self._generated, s.preemptions,
            )  # fmt: skip
            sinks = [self._sinks.get(e.seq) for e in events]
            for seq_id in ended:
                self._sinks.pop(seq_id, None)
        for event, sink in zip(events, sinks, strict=True):
            if sink is not None:
                sink(event)
