"""The cache-policy protocol and its registry.

A method is a frozen dataclass of its own hyperparameters (each default defined there, once),
checked when it is built, registered under its name, with a score over the candidate keys. The
keep rule is common to every method (`rkvjax.kv.selection.select`), so the engine, compression
lanes, prefill compression, sharding, `record_kept`, the command line, job headers, `eval` and
the benchmark suites take any registered method by name.

Methods come from three places: the built-ins (`rkvjax.kv.policies`), packages that declare an
entry point in the group "rkvjax.policies" (`mine = "my_pkg.policy:Mine"`), and modules named in
$RKVJAX_POLICIES (comma-separated; imported once, they call `register`), which is how a command
line (`rkvjax generate --method mine`, `python -m bench fidelity --methods mine`) finds a method
defined in a script of one's own.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import re
import typing
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

PLUGINS_ENV = "RKVJAX_POLICIES"
ENTRY_POINT_GROUP = "rkvjax.policies"
_NAME = re.compile(r"[a-z][a-z0-9_\-]*\Z")


# The per-key states the engine can carry for a method (`Policy.state`), by what they hold.
# "attention": the attention each cached key has received, summed over every query that saw it
# (the prompt's and each decode step's) and over its KV head's query group; a compression moves
# a key's sum with it, a new key starts at its own query's weight.
# "score": the method's own number per key, which only its compressions change: `scores` then
# returns (scores, state [B, K, n] of every key after this compression), and the state of the
# kept keys moves with them; a new key starts at 0.
STATES = {
    "attention": "sums the attention its keys receive at every decode step",
    "score": "carries a score per key from one compression to the next",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """What a compression knows about the rows besides their queries and keys, for methods
    that read it (`Policy.context`). Shapes as in `Policy.scores`."""

    positions: jax.Array  # [B, K, n] int32 each key's logical position (-1: not there)
    pos: jax.Array  # [B] int32 each row's next position: when the compression happens
    prompt: jax.Array  # [B] int32 each row's prompt length (its positions [0, prompt))
    seed: jax.Array  # [B] uint32 the request's seed
    state: jax.Array | None  # [B, K, n] float32 the method's per-key state (`Policy.state`)
    # Which of the model's KV heads the K here are: on a mesh a device scores its own block,
    # heads [head0, head0 + K) of `kv_heads` (a method with per-head constants slices them).
    head0: jax.Array | int = 0  # [] int32
    layer: int = dataclasses.field(default=0, metadata={"static": True})
    kv_heads: int | None = dataclasses.field(default=None, metadata={"static": True})

    @classmethod
    def plain(cls, keys: jax.Array, state: jax.Array | None = None) -> Context:
        """The context of keys [B, K, n] read alone (`keep_indices`): positions 0..n-1 in slot
        order, a prompt of none, seed 0, layer 0."""
        b, k, n = keys.shape[:3]
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, k, n))
        zeros = jnp.zeros((b,), jnp.int32)
        return cls(positions, zeros + n, zeros, zeros.astype(jnp.uint32), state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """Which of a row's older tokens a compression keeps, for one (layer, KV head, row).

    At a compression the cache holds n keys per (row, KV head): the last W (the window) are
    always kept, and of the other n - W candidates the `budget - W` with the highest `scores`,
    ties towards the lower position; keys that are not there (empty slots, padding) are never
    chosen before present ones. A subclass defines `name`, its hyperparameters as fields with
    defaults, `check` for them, and `scores`. It is static: part of the compiled program, so it
    must stay hashable (numbers, strings, tuples).
    """

    name: ClassVar[str]
    # True: `scores` also takes `context=` (a `Context`: positions, the row's prompt length and
    # seed, the layer, the per-key state). A method that reads only queries and keys leaves it.
    context: ClassVar[bool] = False
    # The per-key state the engine carries in the cache for this method (one of `STATES`), or
    # None: the cache holds none, and costs nothing, for methods without one.
    state: ClassVar[str | None] = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raises ValueError naming the first bad hyperparameter (called when built)."""

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        """Scores of the candidates: float32 [B, K, n - W], higher kept first (and, for
        `state = "score"`, the new per-key state [B, K, n] float32 beside them).

        Args:
          queries: [B, N, W, H] the window's queries, post-RoPE; query head h reads KV head
            h // (N / K).
          keys: [B, K, n, H] post-RoPE keys in slot order; the last W are the window's.
          valid: [B, K, n] bool, False for keys that are not there (the window is valid).
          impl: Pallas kernels (True), jnp (False) or auto (None), for methods that have a
            kernel (see `rkvjax.kv.scores.use_pallas`).
          target: the `rkvjax.kv.kernels.tuning.Target` the program is compiled for.
          context: only for a class with `context = True`: a `Context`.

        Scores at invalid candidates are ignored.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no scores()")

    def check_model(self, model) -> None:
        """Raises ValueError, in one line, if the method's settings do not fit `model` (a
        `rkvjax.load` result), e.g. statistics calibrated on another model. An engine asks
        before it compiles anything."""

    def options(self) -> dict[str, Any]:
        """The hyperparameters, by name (what a job header records)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_REGISTRY: dict[str, type[Policy]] = {}
_plugins_loaded = False
_plugin_error: ValueError | None = None  # why loading them failed: raised again on every use


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: makes a `Policy` subclass available by its `name` everywhere a method is
    taken. Registering another class under a taken name is an error (`unregister` it first);
    registering the same class again (a re-run script) replaces it."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register() takes a Policy subclass, got {cls!r}")
    params = cls.__dict__.get("__dataclass_params__")  # set by the decorator on this class
    if params is None or not params.frozen:
        raise TypeError(
            f"{cls.__name__} must be a frozen dataclass "
            "(@dataclasses.dataclass(frozen=True, kw_only=True)): it is part of a compiled "
            "program's static configuration"
        )
    name = cls.__dict__.get("name")
    if getattr(cls, "state", None) not in (None, *STATES):
        raise ValueError(f"{cls.__name__}.state must be None or one of {tuple(STATES)}")
    if getattr(cls, "state", None) is not None and not getattr(cls, "context", False):
        raise ValueError(
            f"{cls.__name__} keeps a state, which it reads from its context: set context = True"
        )
    if not isinstance(name, str) or not _NAME.match(name) or name == "full":
        raise ValueError(
            f"{cls.__name__}.name must be a lower-case name (letters, digits, '_', '-') other "
            f"than 'full', got {name!r}"
        )
    old = _REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"method {name!r} is already registered by {old.__module__}.{old.__qualname__}"
        )
    _REGISTRY[name] = cls
    return cls


def put_first(order: tuple[str, ...]) -> tuple[str, ...]:
    """Lists the registered methods `order` first (in that order); returns `order`."""
    rest = [n for n in _REGISTRY if n not in order]
    reordered = {n: _REGISTRY[n] for n in (*order, *rest)}
    _REGISTRY.clear()
    _REGISTRY.update(reordered)
    return order


def unregister(name: str) -> None:
    """Removes a registered method (a no-op for unknown names)."""
    _REGISTRY.pop(name, None)


def _load_plugins() -> None:
    """Imports the entry points and the $RKVJAX_POLICIES modules, once per process. A plug-in
    that fails to import is one ValueError naming it, raised again on every later use (a
    method list without it would be silently short)."""
    global _plugins_loaded, _plugin_error
    if _plugins_loaded:
        if _plugin_error is not None:
            raise _plugin_error
        return
    _plugins_loaded = True
    try:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                register(ep.load())
            except Exception as e:
                raise ValueError(f"cache policy entry point {ep.value!r}: {_why(e)}") from e
        names = filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")))
        for module in names:
            try:
                importlib.import_module(module)
            except Exception as e:  # a syntax error, or anything its code raises
                raise ValueError(f"${PLUGINS_ENV}: cannot import {module!r}: {_why(e)}") from e
    except ValueError as e:
        _plugin_error = e
        raise


def _why(e: BaseException) -> str:
    """An exception in one line: its type, message and, for a syntax error, where."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({e.filename}, line {e.lineno})"
    return f"{type(e).__name__}: {e}" if not isinstance(e, ImportError) else str(e)


def names() -> tuple[str, ...]:
    """Every registered method, built-ins first."""
    _load_plugins()
    return tuple(_REGISTRY)


def get(name: str) -> type[Policy]:
    """The registered class of method `name`; ValueError naming the known ones otherwise."""
    _load_plugins()
    if name == "full":
        raise ValueError(
            f"method 'full' never compresses, so it has no keep set; expected one of {names()}"
        )
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; expected one of {names()}") from None


def option_names(name: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(get(name)))


def build(name: str, **options) -> Policy:
    """Method `name` with `options` (the rest at their defaults), checked."""
    cls = get(name)
    known = option_names(name)
    for key in options:
        if key not in known:
            takes = f"its options: {', '.join(known)}" if known else "it takes none"
            raise ValueError(f"method {name!r} has no option {key!r} ({takes})")
    return cls(**options)


def parse_options(name: str, items: list[str] | None) -> dict[str, Any]:
    """`KEY=VALUE` strings (a command line's) as method `name`'s options, each converted to the
    type its field declares (int, float, bool, str)."""
    cls = get(name)
    hints = typing.get_type_hints(cls)
    known = option_names(name)
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"a method option is KEY=VALUE, got {item!r}")
        if key not in known:
            takes = f"its options: {', '.join(known)}" if known else "it takes none"
            raise ValueError(f"method {name!r} has no option {key!r} ({takes})")
        if key in out:
            raise ValueError(
                f"option {key} given twice ({key}={out[key]!r} and {item!r}): give it once"
            )
        out[key] = _convert(key, text.strip(), hints.get(key, str))
    return out


def _convert(key: str, text: str, kind) -> Any:
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if kind in (int, float):
            return kind(text)
    except ValueError:
        raise ValueError(f"option {key} must be {kind.__name__}, got {text!r}") from None
    return text
