"""Continuous batching: which sequences run in the next step, and with which rows.

Each step plans, in order:
1. admission: waiting sequences join (oldest first) while fewer than `max_seqs` run and the pool has the blocks
   for their whole prompt; the first that cannot get them waits, and so do those behind it;
2. one decode row for every running sequence past its prefill, each given the block its next row needs; when
   the pool is empty the newest running sequence is preempted (its blocks freed, itself sent back to the head
   of the queue to be prefilled again from its tokens, which it keeps with its sampler's state);
3. prefill chunks from at most `chunk` prompt rows in all, oldest sequence first, so a long prompt is prefilled
   a chunk a step and the running streams keep getting a token every step.
Then `apply` takes the lane's sampled tokens: stop tokens, stop strings, `max_tokens` and the context's end
finish a sequence, whose blocks go back to the pool at once.

Overlapped (the engine's `overlap`): while a step of decode rows runs, `plan_ahead` plans the one after it
before its tokens are known, where that is the same rows one on: every running sequence decodes in it, and no
waiting one could join. Each table is grown for its sequence's next row then (a lookahead of one row); where
the pool lacks a block, or a row would pass the context, or the batch changes, it plans nothing and the
engine reads the step's tokens before it plans as above, so joins, prefills and preemptions are planned only
on known tokens. A sequence the step in flight ends (a stop, its length, a cancel) gives its blocks back at
once, though the step after it, launched already, writes its row's key and value into one of them: every
step runs on the lane's one stream, so whatever step later holds that block runs after the write, and
writes each row before it reads it. `apply` drops the rows of sequences no longer running.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from fuselane.engine.blocks import BlockPool
from fuselane.engine.lane import PICKED, Work
from fuselane.engine.sequence import Event, Finish, Sequence


class Scheduler:
    """The queue, the running batch and the pool, driven one step at a time by the engine."""

    def __init__(self, pool: BlockPool, *, ctx: int, max_seqs: int, chunk: int, stop_ids: Iterable[int]) -> None:
        self.pool, self.ctx, self.max_seqs, self.chunk = pool, ctx, max_seqs, chunk
        self.stop_ids = frozenset(stop_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, seq_id: int) -> Sequence | None:
        return next((s for s in (*self.running, *self.waiting) if s.id == seq_id), None)

    def end(self, seq: Sequence, finish: Finish) -> None:
        """Take `seq` out of the queue or the batch and give its blocks back."""
        seq.finish = finish
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.table)

    def plan(self) -> list[Work]:
        """The next step's work: decode rows first, then prefill chunks."""
        self._admit()
        works = self._decode_rows()
        return works + self._prefill_chunks()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            head = self.waiting[0]
            if not self.pool.grow(head.table, len(head.tokens)):
                return
            self.running.append(self.waiting.popleft())

    def _decode_rows(self) -> list[Work]:
        works, i = [], 0
        while i < len(self.running):
            seq = self.running[i]
            if not seq.prefilling and self._room_for_row(seq):
                works.append(Work(seq.id, (seq.tokens[-1],), seq.cached, seq.table, seq.sampler))
            i += 1
        return works

    def _room_for_row(self, seq: Sequence) -> bool:
        """Give `seq` the block of its next row, preempting the newest sequences while the pool has none; False
        when `seq` itself was the newest and made way. The pool holds at least one whole context, so a sequence
        running alone always gets its block."""
        while not self.pool.grow(seq.table, seq.cached + 1):
            victim = self.running.pop()
            self.pool.release(victim.table)
            victim.cached = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
            if victim is seq:
                return False
        return True

    def plan_ahead(self, works: Seq[Work]) -> list[Work] | None:
        """The step after `works` (decode rows in flight, their tokens not read), planned before they are
        read: the same sequences in the same order, each a row on, fed the token `works` picks (`PICKED`); None
        where the next step must be planned on the tokens (see the module)."""
        if len(works) != len(self.running) or self._could_admit():
            return None
        by_id = {s.id: s for s in self.running}
        ahead = []
        for w in works:
            seq, pos = by_id.get(w.seq), w.pos + 1
            # a row at the context's end is the last (its token ends the sequence); a dry pool preempts
            if seq is None or pos >= self.ctx or not self.pool.grow(seq.table, pos + 1):
                return None
            ahead.append(Work(seq.id, (PICKED,), pos, seq.table, seq.sampler))
        return ahead

    def _could_admit(self) -> bool:
        """Whether the queue's head would join the batch at the next plan."""
        if not self.waiting or len(self.running) >= self.max_seqs:
            return False
        head = self.waiting[0]
        return self.pool.needed(head.table, len(head.tokens)) <= self.pool.free

    def _prefill_chunks(self) -> list[Work]:
        works, budget = [], self.chunk
        for seq in self.running:
            if budget == 0:
                break
            if seq.prefilling:
                n = min(budget, len(seq.tokens) - 1 - seq.cached)
                works.append(Work(seq.id, tuple(seq.tokens[seq.cached : seq.cached + n]), seq.cached, seq.table, None))
                budget -= n
        return works

    def apply(self, works: Seq[Work], tokens: Seq[int | None]) -> list[Event]:
        """Account for a step the lane ran: rows cached, tokens sampled; the events it makes. A row of a
        sequence no longer running (ended while the overlapped step ran) is dropped."""
        by_id = {s.id: s for s in self.running}
        events = []
        for work, token in zip(works, tokens, strict=True):
            seq = by_id.get(work.seq)
            if seq is None:
                continue
            seq.cached += len(work.ids)
            if token is not None:
                events.append(self._take(seq, token))
        return events

    def _take(self, seq: Sequence, token: int) -> Event:
        if token in self.stop_ids and not seq.request.ignore_eos:
            self.end(seq, Finish.STOP)
            return seq.event(seq.text.flush())
        seq.tokens.append(token)
        seq.generated += 1
        text = seq.text.push(token)
        if seq.text.stopped:
            self.end(seq, Finish.STOP)
        elif seq.generated == seq.request.max_tokens or len(seq.tokens) > self.ctx:
            # past the context: the next row would be at position ctx, which the cache does not have
            self.end(seq, Finish.LENGTH)
            text += seq.text.flush()
        return seq.event(text, (token,))

    def fail(self, works: Seq[Work], message: str) -> list[Event]:
        """The lane failed on a step: its sequences end with the error."""
        events = []
        for seq_id in dict.fromkeys(w.seq for w in works):
            seq = self.find(seq_id)
            if seq is not None:
                self.end(seq, Finish.ERROR)
                events.append(seq.event("", error=message))
        return events
