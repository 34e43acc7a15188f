"""Which sample goes into which row of the device state, and when: the runtime's decisions, as
plain data.

The scheduler keeps the queue of samples waiting for rows and which sample each row holds, and
decides: which prompts are prefilled together and which rows their samples take (`admit`, an
`Admission`), when a decode chunk should stop early so that freed rows are refilled
(`refill_at`), and when the state narrows to the rows still busy or widens again (`narrow`, and
`admit`'s `widen`, as a `Resize`). The executor carries the plans out on the device; chunk
outcomes come back as the samples that finished (`free`). Nothing here imports JAX or calls the
layers below (vLLM v1's discipline: `vllm/v1/core/sched/output.py`), so tests drive it with
fake requests, no model.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence

from rkvjax.runtime import requests
from rkvjax.runtime.samples import Pending, Sample

# A run narrows only while its longest row may still run this many chunks: fewer steps than
# that would not pay for compiling the narrower program on a first run.
NARROW_MIN_CHUNKS = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The shape of the runtime the scheduler plans for."""

    slots: int  # rows of the full-width state, a multiple of data_shards
    data_shards: int = 1  # the mesh's "data" axis: rows are split into this many blocks
    chunk: int = 16  # decode steps per chunk
    max_prefill_rows: int  # prompts prefilled together at most
    max_positions: int  # the model's positions: the last prompt-length bucket ends there
    prefill_by_length: bool = True  # a prefill group per prompt-length bucket (else one)
    narrow_tail: bool = True  # narrow the state to the busy rows in the tail of a run

    def __post_init__(self):
        if self.slots % self.data_shards:
            raise ValueError(
                f"slots ({self.slots}) must be a multiple of data_shards ({self.data_shards})"
            )


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Prefill these prompts together into the group `group`: `rows` rows (a bucket: the
    prompts, then empty rows), each left-padded to the longest prompt's length bucket."""

    group: int
    prompts: tuple[tuple[int, ...], ...]
    rows: int
    seeds: tuple[int | None, ...] = ()  # each prompt's request seed (random eviction draws)


@dataclasses.dataclass(frozen=True)
class Insert:
    """Put prefilled row src[i] of group `group` into row dst[i] of the state (which has
    `width` rows) for samples[i]; padded to `rows` entries (a bucket), the padding's dst being
    `width` (dropped). `prefill` comes first when the group is new; `last_use`: no sample waits
    on the group any more, its rows may go."""

    group: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    samples: tuple[Sample, ...]
    rows: int
    width: int
    prefill: Prefill | None
    last_use: bool


@dataclasses.dataclass(frozen=True)
class Resize:
    """A state of `width` rows made from the current one.

    narrow: the new state is the current one's rows `rows`, taken per data shard: `rows` holds
      each shard's local row indices in turn, `width / data_shards` of them each.
    widen: the current state's rows go to `rows` of an empty state of `width` rows (each shard's
      local indices in turn, as for narrow).
    """

    kind: str  # "narrow" or "widen"
    width: int
    rows: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Admission:
    """What an admission does, in order: widen the state (when it must), then the inserts,
    each after its group's prefill."""

    widen: Resize | None
    inserts: tuple[Insert, ...]


class Scheduler:
    """The queue and the rows' owners; every decision as data (see the module docstring)."""

    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.queue: collections.deque[Pending] = collections.deque()
        # Row b of the device state holds owner[b]; a narrowed state has fewer rows than slots.
        self.owner: list[Sample | None] = [None] * cfg.slots
        self.busy = 0  # rows holding a sample
        self.peak_busy = 0  # most rows busy at once
        self.counts: collections.Counter = collections.Counter()  # narrowings, widenings
        self._release: set[int] = set()  # rows freed while the device still runs them
        self._narrow_wish: int | None = None  # rows per shard the last round could narrow to
        self._groups = itertools.count()

    # -- the queue ----------------------------------------------------------------------------

    def add(self, samples: Sequence[Sample]) -> None:
        """Queues the samples of one request (they share its prefill)."""
        self.queue.append(Pending(list(samples)))

    @property
    def width(self) -> int:
        """Rows of the device state now."""
        return len(self.owner)

    @property
    def has_work(self) -> bool:
        """Whether samples wait or run."""
        return bool(self.queue) or self.busy > 0

    def waiting(self, enough: int) -> int:
        """Samples waiting in the queue, counted up to at least `enough` of them: every queued
        request has a sample left, so its first `enough` entries tell, without a pass over a
        long queue on every chunk."""
        return sum(len(p.samples) for p in itertools.islice(self.queue, enough))

    def refill_at(self) -> int:
        """Free rows at which the next chunk stops early: with requests waiting, as soon as a
        few slots free up (1 in 16 of them, at least one), so they are refilled a chunk
        sooner; with nothing waiting, never. Chunks stay long when slots free up one by one
        in a large batch, and the host keeps one chunk in flight either way."""
        need = max(1, self.cfg.slots // 16)
        waiting = self.waiting(need)
        return min(waiting, need) if waiting else self.cfg.slots + 1

    # -- admission ----------------------------------------------------------------------------

    def admit(self) -> Admission | None:
        """Fills free rows from the queue: a prompt prefilled earlier whose other samples wait
        goes first (its prefill is kept, not repeated); then the next new prompts, as many
        whole requests as fit and part of the next, prefilled by length bucket. A narrowed
        state whose free rows are too few for the waiting samples widens first. None: nothing
        to do."""
        widen = None
        if self.width < self.cfg.slots:
            free = self.width - self.busy
            waiting = self.waiting(self.cfg.slots)  # enough to size the wider state
            if waiting > free:
                widen = self._widen(waiting)
        inserts: list[Insert] = []
        while self.queue:
            free = [b for b, s in enumerate(self.owner) if s is None]
            if not free:
                break
            head = self.queue[0]
            if head.group is not None:
                take = head.samples[: len(free)]
                del head.samples[: len(take)]
                if not head.samples:
                    self.queue.popleft()
                src = [head.src] * len(take)
                inserts.append(self._insert(head.group, src, take, free, None, not head.samples))
                continue
            entries, need = [], 0
            while self.queue and self.queue[0].group is None and need < len(free):
                if len(entries) == self.cfg.max_prefill_rows:
                    break
                entries.append(self.queue.popleft())
                need += len(entries[-1].samples)
            takes, left = [], len(free)  # rows in queue order: only the last entry may wait
            for e in entries:
                takes.append(e.samples[:left])
                left -= len(takes[-1])
            for members in self._prefill_groups(entries):
                prefill = self._prefill([entries[i].samples[0].request for i in members])
                src, samples, kept = [], [], False
                for j, i in enumerate(members):
                    e = entries[i]
                    del e.samples[: len(takes[i])]
                    src += [j] * len(takes[i])
                    samples += takes[i]
                    if e.samples:  # the rest of its samples wait for rows, prefilled
                        e.group, e.src = prefill.group, j
                        self.queue.appendleft(e)
                        kept = True
                inserts.append(self._insert(prefill.group, src, samples, free, prefill, not kept))
                free = [b for b in free if self.owner[b] is None]
        if widen is None and not inserts:
            return None
        return Admission(widen, tuple(inserts))

    def _prefill_groups(self, entries: list[Pending]) -> list[list[int]]:
        """Which of the prompts admitted together share a prefill: those of one length
        bucket (a group pads every prompt to its longest, so a 40-token prompt beside a
        400-token one would cost as much as the long one), or all of them."""
        if not self.cfg.prefill_by_length:
            return [list(range(len(entries)))]
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            n = len(e.samples[0].request.prompt_token_ids)
            groups.setdefault(requests.bucket(n, self.cfg.max_positions), []).append(i)
        return list(groups.values())

    def _prefill(self, reqs: list[requests.Request]) -> Prefill:
        rows = requests.row_bucket(len(reqs), self.cfg.max_prefill_rows, self.cfg.data_shards)
        prompts = tuple(r.prompt_token_ids for r in reqs)
        # The engine gives every request a seed when it is submitted (random eviction draws
        # from it already at the prompt's compression); the executor refuses one without.
        seeds = tuple(r.sampling.seed for r in reqs)
        return Prefill(next(self._groups), prompts, rows, seeds)

    def _insert(
        self,
        group: int,
        src: list[int],
        samples: list[Sample],
        free: list[int],
        prefill: Prefill | None,
        last_use: bool,
    ) -> Insert:
        """Samples[i] into free rows (`place`) from prefilled rows src[i]."""
        width = self.width
        dst = self.place(samples, free)
        r = requests.row_bucket(len(samples), width)
        for row, s in zip(dst, samples, strict=True):
            self.owner[row] = s
            s.row = row
        self.busy += len(samples)
        self.peak_busy = max(self.peak_busy, self.busy)
        pad = r - len(samples)
        return Insert(
            group=group,
            src=(*src, *[0] * pad),
            dst=(*dst, *[width] * pad),
            samples=tuple(samples),
            rows=r,
            width=width,
            prefill=prefill,
            last_use=last_use,
        )

    def place(self, samples: Sequence[Sample], free: Sequence[int]) -> list[int]:
        """Free rows for `samples`, spread over the data shards so that the tail can narrow:
        the longest sample first, each into the shard with the fewest rows that may outlive
        it (then the fewest busy rows). Token budgets stand in for lengths. One shard: the
        first free rows."""
        shards = self.shard_rows()
        if len(shards) == 1:
            return list(free[: len(samples)])
        per = len(shards[0])
        open_rows = [[b for b in free if b // per == d] for d in range(len(shards))]
        left = [[_left(s) for s in rows if s is not None] for rows in shards]
        rows = {}
        for i in sorted(range(len(samples)), key=lambda i: -samples[i].request.max_tokens):
            n = samples[i].request.max_tokens
            d = min(
                (d for d in range(len(shards)) if open_rows[d]),
                key=lambda d: (sum(m >= n for m in left[d]), len(left[d]), d),
            )
            rows[i] = open_rows[d].pop(0)
            left[d].append(n)
        return [rows[i] for i in range(len(samples))]

    def shard_rows(self) -> list[list[Sample | None]]:
        """`owner` cut into the data shards' blocks of rows."""
        d = self.cfg.data_shards
        per = self.width // d
        return [self.owner[i * per : (i + 1) * per] for i in range(d)]

    # -- outcomes -------------------------------------------------------------------------------

    def free(self, sample: Sample, *, running: bool) -> None:
        """Frees a finished sample's row; `running` when the device still runs it (a stop
        string the host found): the row is released before it is reused or moved."""
        row = sample.row
        if row is None:
            return
        self.owner[row] = None
        sample.row = None
        self.busy -= 1
        if running:
            self._release.add(row)

    def abort(self, request_id) -> tuple[list[Sample], list[Sample], list[int]]:
        """Takes a request's samples out, each finished with reason "abort": those queued
        leave the queue, those in rows free them (released on the device before reuse, as
        for a stop string). Returns (queued samples, running samples, the prefilled groups no
        sample waits on any more)."""
        queued, groups = [], []
        kept: collections.deque[Pending] = collections.deque()
        for p in self.queue:  # a request's samples are one entry, never empty
            if p.samples[0].request.id != request_id:
                kept.append(p)
                continue
            queued += p.samples
            if p.group is not None:
                groups.append(p.group)
        self.queue = kept
        running = [s for s in self.owner if s is not None and s.request.id == request_id]
        for s in queued + running:
            s.reason = "abort"
        for s in running:
            self.free(s, running=True)
        return queued, running, groups

    def take_release(self) -> list[int]:
        """The rows to stop on the device: freed while running and not refilled since (an
        insert overwrites a row's state anyway)."""
        rows = sorted(b for b in self._release if self.owner[b] is None)
        self._release.clear()
        return rows

    # -- the width of the state -----------------------------------------------------------------

    def narrow(self) -> Resize | None:
        """Moves the busy rows into a state at most half as wide (`narrow_tail`), each data
        shard keeping its own busy rows, the same number each. Only when the last round could
        narrow too, and to the wider of the two widths: a caller that submits a request as each
        one ends (a server) refills the freed row first, instead of the state narrowing and
        widening again on every request. A batch run narrows a round (a chunk) later."""
        wish, self._narrow_wish = self._narrow_wish, None
        if not self.cfg.narrow_tail or self.queue or not self.busy:
            return None
        # Host tokens lag the chunk in flight: an upper bound on the steps left either way.
        left = max(_left(s) for s in self.owner if s is not None)
        shards = self.shard_rows()
        per = len(shards[0])
        most = max(sum(s is not None for s in rows) for rows in shards)
        w = requests.row_bucket(most, per)  # rows per data shard
        if w > per // 2 or left < NARROW_MIN_CHUNKS * self.cfg.chunk:
            return None
        if wish is None:
            self._narrow_wish = w
            return None
        w = max(w, wish)
        assert not self._release, "release the freed rows first: their indices would move"
        local, owner = [], []
        for rows in shards:
            # Idle rows pad a shard's block: they are inactive on the device.
            keep = [j for j, s in enumerate(rows) if s is not None]
            keep += [j for j, s in enumerate(rows) if s is None][: w - len(keep)]
            local += keep
            owner += [rows[j] for j in keep]
        self._own(owner)
        self.counts["narrowings"] += 1
        return Resize("narrow", w * len(shards), tuple(local))

    def _widen(self, waiting: int) -> Resize:
        """Widens a narrowed state for `waiting` new samples, to the narrowest width whose
        free rows take them all (a power of two rows per data shard, at most every slot): one
        request arriving after the run narrowed does not bring back every idle slot. Each data
        shard's rows go to the first rows of its block of the wider state."""
        # Released at the end of the last round; the second admission of a round never widens
        # (the first left the queue empty or the state full width).
        assert not self._release, "release the freed rows first: their indices would move"
        shards = self.shard_rows()
        d, w = len(shards), len(shards[0])
        full = self.cfg.slots // d
        need = min(-(-(self.busy + waiting) // d), full)  # rows per data shard
        per = requests.row_bucket(need, full)
        self._own([s for block in shards for s in block + [None] * (per - w)])
        self._narrow_wish = None  # a width of the narrower state
        self.counts["widenings"] += 1
        return Resize("widen", per * d, tuple(j for _ in range(d) for j in range(w)))

    def _own(self, owner: list[Sample | None]) -> None:
        self.owner = owner
        for b, s in enumerate(owner):
            if s is not None:
                s.row = b


def _left(s: Sample) -> int:
    """Tokens a sample may still make (host tokens lag the chunk in flight)."""
    return s.request.max_tokens - len(s.tokens)
