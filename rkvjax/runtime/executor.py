"""The device side of the slot runtime: the state, the compiled programs, every transfer.

The executor owns the `programs.SlotState` of the runtime's rows and runs the jitted programs of
`rkvjax.runtime.programs` on it as the scheduler's plans say. Host data reaches the device only
through `put`: one explicit `jax.device_put` of a NumPy pytree per insert (its group's prompts
included when the insert comes with a new prefill; on one device each part packed as a buffer per
dtype, `packing`, as the tokens come back), one per early-stop count the first time a chunk
asks for it (kept on the device; a handful of values) and one per release or resize, so a whole
workload runs under `jax.transfer_guard("disallow")`. A chunk's outputs start copying to the host
the moment it is dispatched; the host parses them a round later, while the next chunk runs. The
compilation its calls cause is counted in its own `CompileLog`, so two runtimes in one process
each report their own compile time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rkvjax.kv import compress
from rkvjax.models import sharding
from rkvjax.models.loading import Model
from rkvjax.runtime import packing, programs, requests
from rkvjax.runtime.samples import Sample
from rkvjax.runtime.scheduler import Admission, Insert, Prefill, Resize
from rkvjax.sampling.sampler import SlotSampling


def on_mesh(model: Model):
    """The model's mesh as the context mesh (jit traces see it; shard_map runs over it)."""
    return contextlib.nullcontext() if model.mesh is None else jax.set_mesh(model.mesh)


def _row_sharding(model: Model, x: np.ndarray):
    """Where a host [B, ...] array goes: rows split over "data" when they divide, else whole
    on every device; None on one device."""
    if model.mesh is None:
        return None
    axes = ("batch",) if x.ndim and x.shape[0] % model.data_shards == 0 else (None,)
    return model.rules.named(model.mesh, *axes, *[None] * (x.ndim - 1))


def _whole(model: Model, x: np.ndarray):
    """Whole on every device (small per-request values); None on one device."""
    if model.mesh is None:
        return None
    return model.rules.named(model.mesh, *[None] * x.ndim)


def transfer(tree: Any, shardings: Any = None) -> Any:
    """Host arrays to the device in one explicit transfer: each leaf to its sharding (a tree of
    them like `tree`), or everything to the default device (None). On several processes each
    process fills its own devices' blocks."""
    if shardings is None or jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    return jax.tree.map(lambda x, s: sharding.host_array(np.asarray(x), s), tree, shardings)


def device_rows(model: Model, x) -> jax.Array:
    """A host [B, ...] array on device: rows split over "data" on a mesh when they divide,
    else whole on every device."""
    x = np.asarray(x)
    return transfer(x, _row_sharding(model, x))


def _start_copies(tree: Any) -> None:
    """Starts copying the arrays of `tree` to the host, so that a later fetch waits less."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()


def _tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inserted:
    """An insert's device outputs: each new row's first token (`programs.Tokens` [R, 1],
    packed on one device until fetched) and, when compressions are recorded, what its group's
    prefill compression kept."""

    first: programs.Tokens | packing.Packed
    kept: jax.Array | None


class Executor:
    """The runtime's device state and programs (see the module docstring).

    Args:
      model: from `rkvjax.load`.
      plan: the full-width state's static plan.
      slots: rows of the full-width state.
      capacity, stop_width, given_len: the state's shapes (`programs.init_state`).
      chunk: decode steps per chunk.
    """

    def __init__(
        self,
        model: Model,
        plan: programs.Plan,
        *,
        slots: int,
        capacity: int,
        stop_width: int,
        given_len: int,
        chunk: int,
    ):
        self.model = model
        self.decoder = programs.flat(model.decoder)  # flattened once, not at every call
        self.plan = plan
        self.slots = slots
        self.capacity = capacity
        self.stop_width = stop_width
        self.given_len = given_len
        self.chunk = chunk
        self.state: programs.SlotState | None = None
        self.width = slots
        self.compile = programs.CompileLog()
        self.transfers: collections.Counter[str] = collections.Counter()  # host-to-device calls
        self._groups: dict[int, programs.Prefilled] = {}
        self._refill_at: dict[int, jax.Array] = {}  # each early-stop count on the device
        self._pending: concurrent.futures.Future | None = None  # a state `start_state` makes

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The model's mesh as the context mesh, and compilation counted as this executor's."""
        with on_mesh(self.model), programs.compiling_for(self.compile):
            yield

    def put(self, tree: Any, shardings: Any, kind: str) -> Any:
        """The executor's one way to the device: `tree` (NumPy) in one explicit transfer."""
        self.transfers[kind] += 1
        return transfer(tree, shardings)

    def plan_of(self, width: int) -> programs.Plan:
        """The plan of a `width`-row state: the full width's, with no more lanes than rows."""
        if width == self.slots:
            return self.plan
        lanes = max(1, min(self.plan.lanes, width // self.model.data_shards))
        return dataclasses.replace(self.plan, lanes=lanes)

    def _state_options(self, width: int) -> dict[str, Any]:
        """`programs.init_state`'s static arguments for a state of `width` rows."""
        return dict(
            slots=width,
            capacity=self.capacity,
            stop_width=self.stop_width,
            given_len=self.given_len,
            plan=self.plan_of(width),
        )

    def empty_state(self, width: int | None = None) -> programs.SlotState:
        """Nothing in any row: every slot, or `width` rows of a narrowed run."""
        width = self.slots if width is None else width
        state = programs.init_state(self.decoder, **self._state_options(width))
        if self.model.mesh is None:
            # Committed to the model's device, as every state a program returns is: jit keys
            # its programs on that too, and `warm_widths` compiles on that placement.
            state = jax.device_put(state, self.model.device)
        return state

    def ensure_state(self) -> None:
        if self.state is None:
            pending, self._pending = self._pending, None
            self.state = pending.result() if pending is not None else self.empty_state()
            self.width = self.slots

    def start_state(self) -> None:
        """Makes the empty full-width state on another thread; `ensure_state` takes it (waiting
        for it if need be). A CPU device fills a new state's memory on the calling thread,
        page by page (14 s for 5.7 GiB here), so a server that is otherwise ready need not
        wait for it before it answers."""
        if self.state is not None or self._pending is not None:
            return
        future: concurrent.futures.Future = concurrent.futures.Future()

        def make() -> None:
            try:
                with self.running():
                    future.set_result(self.empty_state())
            except BaseException as e:  # raised again where the state is first needed
                future.set_exception(e)

        self._pending = future
        # Not a daemon: a process that ends meanwhile waits for it rather than tearing JAX's
        # backend down under a running program.
        threading.Thread(target=make, name="rkvjax-state").start()

    # -- plans --------------------------------------------------------------------------------

    def admit(self, admission: Admission) -> list[Inserted]:
        """Carries out an admission: its widening, then each insert (after its prefill)."""
        self.ensure_state()
        if admission.widen is not None:
            self.resize(admission.widen)
        return [self.insert(step) for step in admission.inserts]

    def insert(self, step: Insert) -> Inserted:
        """Prefills the step's group when it is new, then scatters the group's rows into the
        state: every host array of the two in one transfer."""
        dev = self.put(*self._insert_host(step), "insert")
        if step.prefill is not None:
            self._groups[step.group] = self._prefill(dev["prefill"])
        group = self._groups[step.group]
        if step.last_use:
            del self._groups[step.group]
        self.state, first = programs.insert_packed(
            self.state, group, dev["insert"], plan=self.plan_of(step.width)
        )
        record = self.plan.record_kept and self.plan.compression.compressing
        out = Inserted(first, group.kept if record else None)
        _start_copies(out)
        return out

    def _prefill(self, dev: Any) -> programs.Prefilled:
        return programs.prefill_packed(self.decoder, dev, capacity=self.capacity, plan=self.plan)

    def _insert_host(self, step: Insert) -> tuple[dict[str, Any], Any]:
        """An insert's host arrays, {"insert": ..., "prefill": ...} (the prefill's only when
        the group is new; each part packed on one device), and where each goes (None on one
        device)."""
        model = self.model
        host: dict[str, Any] = {
            "insert": {
                "src": np.asarray(step.src, np.int32),
                "dst": np.asarray(step.dst, np.int32),
                "new": self.new_rows(step.samples, step.rows),
            }
        }
        if step.prefill is not None:
            tokens, positions = requests.pad_left(
                step.prefill.prompts, step.prefill.rows, model.config.max_positions
            )
            if len(step.prefill.seeds) != len(step.prefill.prompts) or None in step.prefill.seeds:
                raise AssertionError("every prefilled prompt needs its request's seed")
            seeds = np.zeros(len(tokens), np.uint32)  # and 0 for the padding rows
            seeds[: len(step.prefill.seeds)] = step.prefill.seeds
            host["prefill"] = {"tokens": tokens, "positions": positions, "seeds": seeds}
        if model.mesh is None:
            return {k: packing.packed(v) for k, v in host.items()}, None
        # The prompts' rows split like the batch, the rest whole on every device.
        where = {"insert": jax.tree.map(lambda x: _whole(model, x), host["insert"])}
        if "prefill" in host:
            where["prefill"] = jax.tree.map(lambda x: _row_sharding(model, x), host["prefill"])
        return host, where

    def drop_group(self, group: int) -> None:
        """Forgets a prefilled group whose waiting samples were aborted."""
        self._groups.pop(group, None)

    def new_rows(self, samples: tuple[Sample, ...], rows: int) -> programs.NewRows:
        """The per-row values of an insert, as NumPy, padded to `rows` rows."""
        stop = np.full((rows, self.stop_width), -1, np.int32)
        block = np.full((rows, self.stop_width), -1, np.int32)
        max_tokens = np.ones(rows, np.int32)
        given = np.zeros((rows, self.given_len), np.int32)
        for i, s in enumerate(samples):
            q = s.request
            max_tokens[i] = q.max_tokens
            if q.continuation is not None:  # teacher forcing: no stop ids
                given[i, : len(q.continuation)] = q.continuation
                continue
            stop[i, : len(q.stop_ids)] = q.stop_ids
            block[i, : len(q.block_ids)] = q.block_ids
        sampling = SlotSampling.from_params(
            [s.request.sampling for s in samples],
            batch=rows,
            sample_indices=[s.index for s in samples],
            host=True,
        )
        return programs.NewRows(
            max_tokens=max_tokens, stop_ids=stop, block_ids=block, sampling=sampling, given=given
        )

    def dispatch(self, refill_at: int) -> programs.Tokens:
        """Runs the next decode chunk (asynchronously) and starts copying its outputs back."""
        at = self._refill_at.get(refill_at)
        if at is None:
            # A value, not a shape: never recompiles. The scheduler asks for at most
            # slots / 16 + 1 values, so each is moved once and kept (the chunk does not donate
            # it), and a chunk's dispatch moves nothing.
            host = np.int32(refill_at)
            at = self._refill_at[refill_at] = self.put(host, _whole(self.model, host), "chunk")
        self.state, out = programs.decode_packed(
            self.decoder,
            self.state,
            steps=self.chunk,
            plan=self.plan_of(self.width),
            refill_at=at,
        )
        _start_copies(out)
        return out

    def release(self, rows: list[int]) -> None:
        """Stops the given rows on the device (the host found their samples' stop strings)."""
        mask = np.zeros(self.width, bool)
        mask[rows] = True
        mask = self.put(mask, _row_sharding(self.model, mask), "release")
        self.state = programs.release(self.state, mask, plan=self.plan_of(self.width))

    def resize(self, resize: Resize) -> None:
        """A narrower or wider state, rows moving per data shard (`Resize`)."""
        rows = np.asarray(resize.rows, np.int32)
        rows = self.put(rows, _row_sharding(self.model, rows), "resize")
        plan = self.plan_of(resize.width)
        if resize.kind == "narrow":
            self.state = programs.take_rows(self.state, rows, plan=plan)
        else:
            wide = self.empty_state(resize.width)
            self.state = programs.put_rows(wide, self.state, rows, plan=plan)
        self.width = resize.width

    def warm_widths(self, prompt: Sequence[int], *, narrow: bool = True) -> list[int]:
        """Compiles, without running them, the programs of every width the state can narrow or
        widen to: the empty state, the decode chunk, the release and one prompt's insert (as
        one arrival into a narrowed batch) at each, and the row moves between each two, so that
        a change of load never waits on a compilation (a server calls it at start);
        `narrow=False`: the full width only. Returns the widths.

        Nothing runs but the prompt's one-row prefill: every other program is lowered on the
        state's shapes and compiled ahead of time, which puts it where the live call finds it
        (with a warm compile cache, a load from disk). Running them instead would allocate and
        move whole states of every width and decode chunks on empty rows: minutes for a
        server whose rows hold long contexts. The live state is never touched, so it may run
        on another thread while this one serves (JAX compiles thread-safely; a program the
        live run needs first is compiled by whichever thread gets there first)."""
        d = self.model.data_shards
        per = self.slots // d
        # `Scheduler.narrow` and `_widen`: a power of two rows per data shard, or all of them.
        ladder = sorted({min(1 << k, per) for k in range(per.bit_length() + 1)})
        ladder = ladder if narrow else [per]
        prefill = Prefill(-1, (tuple(prompt),), requests.row_bucket(1, self.slots, d), (0,))
        states = {w: self._compile_empty_state(w * d) for w in ladder}
        group = None
        # Plain transfers, not `put`: they are no run's, and may happen on another thread.
        for w in ladder:
            rows, plan = w * d, self.plan_of(w * d)
            step = Insert(-1, (0,), (rows,), (), 1, rows, prefill if group is None else None, False)
            dev = transfer(*self._insert_host(step))
            if group is None:
                group = self._prefill(dev["prefill"])
            programs.insert_packed.lower(states[w], group, dev["insert"], plan=plan).compile()
            at = np.int32(self.slots + 1)
            at = transfer(at, _whole(self.model, at))
            programs.decode_packed.lower(
                self.decoder, states[w], steps=self.chunk, plan=plan, refill_at=at
            ).compile()
            mask = np.zeros(rows, bool)
            mask = transfer(mask, _row_sharding(self.model, mask))
            programs.release.lower(states[w], mask, plan=plan).compile()
            for v in (v for v in ladder if v < w):
                moved = np.asarray(tuple(range(v)) * d, np.int32)
                moved = transfer(moved, _row_sharding(self.model, moved))
                programs.take_rows.lower(states[w], moved, plan=self.plan_of(v * d)).compile()
                programs.put_rows.lower(states[w], states[v], moved, plan=plan).compile()
        return [w * d for w in ladder]

    def _compile_empty_state(self, width: int) -> Any:
        """Compiles `empty_state(width)`'s program; returns the state's shapes, dtypes and
        placements as the live one has them (ShapeDtypeStructs)."""
        lowered = programs.init_state.lower(self.decoder, **self._state_options(width))
        out = lowered.compile().out_info
        if self.model.mesh is None:  # `empty_state` commits it to the model's device
            placed = jax.sharding.SingleDeviceSharding(self.model.device)
            out = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), out
            )
        return out

    @staticmethod
    def fetch(tree: Any) -> Any:
        """Device outputs as NumPy, unpacked (on several processes, each process gets the
        whole)."""
        return packing.unpacked(sharding.to_host(tree))

    # -- sizing -------------------------------------------------------------------------------

    def state_shapes(self) -> programs.SlotState:
        """The shapes, dtypes and shardings of the full-width state (nothing allocated)."""
        with on_mesh(self.model):
            options = self._state_options(self.slots)
            return jax.eval_shape(lambda d: programs.init_state(d, **options), self.decoder)

    def memory_analysis(self, *, prompt_len: int, prefill_rows: int, parts=("decode",)) -> dict:
        """Compile-only memory of the programs; see `Engine.memory_analysis`."""
        state = self.state_shapes()
        out = {"state_bytes": _tree_bytes(state), "cache_bytes": _tree_bytes(state.cache)}
        tokens = jax.ShapeDtypeStruct(
            (prefill_rows, requests.bucket(prompt_len, prompt_len)), jnp.int32
        )
        with self.running():
            for name in parts:
                if name == "decode":
                    lowered = programs.decode.lower(
                        self.decoder, state, steps=self.chunk, plan=self.plan
                    )
                elif name == "prefill":
                    seeds = jax.ShapeDtypeStruct(tokens.shape[:1], jnp.uint32)
                    lowered = programs.prefill.lower(
                        self.decoder, tokens, tokens, seeds, capacity=self.capacity, plan=self.plan
                    )
                elif name == "compress":
                    full = jax.ShapeDtypeStruct((self.slots,), jnp.bool_)
                    start = jax.ShapeDtypeStruct((), jnp.int32)
                    lowered = jax.jit(self._compress_step).lower(state.cache, full, start)
                else:
                    raise ValueError(f"unknown part {name!r}: decode, prefill or compress")
                ma = lowered.compile().memory_analysis()
                part = {
                    "argument_bytes": ma.argument_size_in_bytes,
                    "output_bytes": ma.output_size_in_bytes,
                    "alias_bytes": ma.alias_size_in_bytes,
                    "temp_bytes": ma.temp_size_in_bytes,
                }
                part["peak_bytes"] = sum(part.values()) - 2 * part["alias_bytes"]
                out[name] = part
        return out

    def _compress_step(self, cache, full, start):
        """One step of the compression lanes (for `memory_analysis`)."""
        plan = self.plan
        return compress.compress_lanes(
            cache, full, plan.compression, lanes=plan.lanes, start=start, rules=plan.rules
        )
