"""The engine's own thread: the one place a served `Engine` is driven.

JAX calls block and `Engine` is not thread-safe, so one thread owns the engine and the HTTP
handlers talk to it through an inbox (requests to submit, ids to abort). Between rounds the
thread takes the inbox, runs `Engine.step`, and hands each request's deltas and results to the
event loop that waits for them (`loop.call_soon_threadsafe`, one call per request and round).
While nothing waits or runs it sleeps on the inbox. Numbers for `/metrics` are copied after
every round into a snapshot the event loop reads without locks (`Snapshot`); requests still in
the inbox (the engine thread is busy with a round, say a long prefill) count as waiting from the
moment they arrive (`current`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from typing import Any

from rkvjax.runtime.requests import Request
from rkvjax.runtime.results import GenerationResult, RunStats, StreamDelta

log = logging.getLogger("rkvjax.serve")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The engine's numbers after a round, for `/metrics` and `/health`: the queue and rows
    now, and the engine's counters (`Engine.stats`; None before the first round)."""

    waiting: int = 0  # requests queued, not yet in a row
    running: int = 0  # requests with a sample in a row
    busy_slots: int = 0
    slots: int = 0
    stats: RunStats | None = None

    def count(self, name: str) -> int:
        """A counter of `RunStats` (0 before the first round)."""
        return 0 if self.stats is None else getattr(self.stats, name)


class ShutDown(Exception):
    """The event of a request the server aborted because it is shutting down."""


@dataclasses.dataclass(eq=False)
class Handle:
    """One submitted request as the event loop sees it: its samples' deltas (streamed) or
    results arrive on `events`, then None; an error the engine raised, as the exception."""

    request: Request
    stream: bool
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)


class EngineWorker:
    """Owns an `Engine` on a thread of its own (see the module docstring).

    Args:
      engine: the served engine (not driven by anything else).
      loop: the event loop whose handlers wait on the requests' events.
      metrics: told on the engine thread of every finished sample (`observe(result)`) and
        of the numbers after every round (`tick(snapshot)`).
      scorer: a scoring engine (`Engine(teacher=True)`) for requests with a continuation (an
        echoed prompt's log-probabilities), stepped on the same thread between the served
        engine's rounds; its programs compile at its first request.
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, metrics=None, scorer=None):
        self.engine = engine
        self.scorer = scorer
        self.loop = loop
        self.snapshot = Snapshot(slots=engine.slots)
        self._metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[Any, Handle] = {}  # the engine thread's own
        self._left: dict[Any, int] = {}  # samples of each request not finished
        # Guards the two marks below against a submit racing the engine thread's end.
        self._lock = threading.Lock()
        self._closed: BaseException | None = None  # why submits are answered at once
        self._inbox_requests = 0  # submitted, not yet in a snapshot's count (under _lock)
        self._taken = 0  # taken from the inbox since the last snapshot (the engine thread's)
        self._thread = threading.Thread(target=self._run, name="rkvjax-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def current(self) -> Snapshot:
        """The last round's numbers, with the requests that arrived since counted as waiting."""
        with self._lock:  # the two as one snapshot left them: a request counted once
            snapshot, arrived = self.snapshot, self._inbox_requests
        if not arrived:
            return snapshot
        return dataclasses.replace(snapshot, waiting=snapshot.waiting + arrived)

    # -- called from the event loop -------------------------------------------------------

    def submit(self, request: Request, *, stream: bool) -> Handle:
        """Queues a prepared request (`Engine.prepare`); its events arrive on the handle. Once
        the engine thread failed or the server aborted everything, the handle gets that error
        at once (called on the event loop's thread)."""
        handle = Handle(request, stream)
        with self._lock:
            closed = self._closed
            if closed is None:
                self._inbox_requests += 1
                self._inbox.put(("submit", handle))
                return handle
        _put_all(handle.events, [closed, None])
        return handle

    def abort(self, request_id: Any) -> None:
        """Stops a request at the engine's next round (a no-op once it finished)."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Aborts every request at the engine's next round; each gets a `ShutDown` event, and
        so does any request submitted later."""
        with self._lock:
            self._closed = self._closed or ShutDown(
                "the server shut down before the request finished"
            )
            self._inbox.put(("abort_all", None))

    def stop(self, timeout: float | None = None) -> None:
        """Aborts whatever still runs and ends the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engines = [e for e in (self.engine, self.scorer) if e is not None]
        try:
            while self._take_inbox(block=not any(e.has_work for e in engines)):
                # What the inbox brought counts as waiting in the engine now (and an abort
                # may have left it idle).
                self._update_snapshot()
                for engine in engines:  # a round of each, so neither waits on the other
                    if not engine.has_work:
                        continue
                    finished = engine.step()
                    # The numbers first: a client that got this round's events reads them.
                    self._update_snapshot()
                    self._publish(engine.take_deltas(), finished)
        except BaseException as e:  # the server answers 500 from now on and says why
            log.exception("the engine thread failed")
            self.error = e
            with self._lock:
                self._closed = e
            for h in self._handles.values():
                self._send(h, [e, None])
            self._handles.clear()
            while True:  # requests submitted before the mark was set
                try:
                    kind, value = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._send(value, [e, None])

    def _take_inbox(self, *, block: bool) -> bool:
        """Carries out what the inbox holds (waiting for one message when `block`); False
        once asked to stop."""
        try:
            msg = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, value = msg
            if kind == "stop":
                for rid in list(self._handles):
                    self._abort(rid)
                return False
            if kind == "submit":
                self._submit(value)
                self._taken += 1
            elif kind == "abort":
                self._abort(value)
            else:
                for rid, h in list(self._handles.items()):
                    self._abort(rid)
                    self._send(h, [self._closed, None])
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _submit(self, handle: Handle) -> None:
        r = handle.request
        engine = self._engine_of(r)
        try:
            if engine is None:
                raise ValueError("this server scores no continuations (it has no scorer)")
            engine.submit_many([r], stream=handle.stream)
        except ValueError as e:  # checked when prepared; an id in use is the one way here
            self._send(handle, [e, None])
            return
        except BaseException as e:  # the thread ends; this handle is in no list yet
            self._send(handle, [e, None])
            raise
        self._handles[r.id] = handle
        self._left[r.id] = r.sampling.n

    def _engine_of(self, request: Request):
        """The engine a request runs on: the scorer's for a continuation (None without one)."""
        return self.engine if request.continuation is None else self.scorer

    def _abort(self, request_id: Any) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            del self._left[request_id]
            self._engine_of(handle.request).abort(request_id)

    def _publish(self, deltas: list[StreamDelta], finished: list[GenerationResult]) -> None:
        """Hands each request its events of this round, in one call per request."""
        out: dict[Handle, list] = collections.defaultdict(list)
        for d in deltas:  # a finished sample's last delta comes before its result
            h = self._handles.get(d.request_id)
            if h is not None:
                out[h].append(d)
        for r in finished:
            if self._metrics is not None and isinstance(r, GenerationResult):
                self._metrics.observe(r)
            h = self._handles.get(r.request_id)
            if h is None:
                continue
            if not h.stream:
                out[h].append(r)
            self._left[r.request_id] -= 1
            if not self._left[r.request_id]:
                out[h].append(None)
                del self._handles[r.request_id], self._left[r.request_id]
        for h, events in out.items():
            self._send(h, events)

    def _send(self, handle: Handle, events: list) -> None:
        self.loop.call_soon_threadsafe(_put_all, handle.events, events)

    def _update_snapshot(self) -> None:
        e = self.engine
        running = {s.request.id for s in e.scheduler.owner if s is not None}
        snapshot = Snapshot(
            waiting=len(e.scheduler.queue),
            running=len(running),
            busy_slots=e.busy_slots,
            slots=e.slots,
            stats=e.stats,
        )
        with self._lock:  # the requests taken from the inbox are in this snapshot's count now
            self.snapshot = snapshot
            self._inbox_requests -= self._taken
        self._taken = 0
        if self._metrics is not None:
            self._metrics.tick(snapshot)


def _put_all(q: asyncio.Queue, events: list) -> None:
    for ev in events:
        q.put_nowait(ev)
