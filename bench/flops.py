"""Matrix-product FLOPs of a compiled program, each loop body counted as often as it runs.

`Compiled.cost_analysis()["flops"]` counts a `while` body once, whatever its trip count, so a
product computed one tile at a time under `lax.map` reads as a single tile's work. This count
reads the optimised HLO (`Compiled.as_text()`): every `dot`'s 2 x output elements x contracted
size, summed over the computations that call it (fusions, calls, loop bodies), a loop body times
the trip count XLA proved for it (`known_trip_count`). A loop whose trip count XLA does not know
is an error, not a guess. Element-wise work (activations, norms, softmax) is not counted: for a
model's weights the products are the work, and a count of products means the same on every
backend.
"""

from __future__ import annotations

import json
import math
import re

_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_NAME = r"%?([\w.\-]+)"
_CALLS = re.compile(r"\bcalls=" + _NAME)
_APPLIES = re.compile(r"\bto_apply=" + _NAME)
_BODY = re.compile(r"\bbody=" + _NAME)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"\b(?:true|false)_computation=" + _NAME)
_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
# Library products an accelerator's compiler emits in place of `dot`s (cuBLAS, oneDNN...).
_LIBRARY_PRODUCT = re.compile(r'custom_call_target="[^"]*(gemm|matmul|conv)', re.IGNORECASE)


def _closing(text: str) -> int:
    """The index of the parenthesis closing text's first one."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text[:80]!r}")


def _instruction(line: str) -> tuple[str, str, str, str] | None:
    """`[ROOT] %name = TYPE op(operands), attributes` -> (name, TYPE, op, the rest), or None
    for a line that is not an instruction. TYPE is an array (`f32[8,16]{1,0}`) or a tuple,
    which may nest and holds spaces."""
    line = line.strip().removeprefix("ROOT ")
    name, eq, rhs = line.partition(" = ")
    if not eq:
        return None
    if rhs.startswith("("):
        end = _closing(rhs)
        type_, rest = rhs[: end + 1], rhs[end + 1 :].strip()
    else:
        type_, _, rest = rhs.partition(" ")
    op, paren, rest = rest.partition("(")
    return (name.lstrip("%"), type_, op, rest) if paren else None


def _shape(text: str) -> tuple[int, ...] | None:
    m = _ARRAY.match(text)
    return None if m is None else tuple(int(d) for d in m.group(1).split(",") if d)


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head and current is None:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _trip_count(line: str, name: str) -> int:
    m = re.search(r"backend_config=(\{.*\})\s*$", line)
    n = None
    if m:
        try:
            n = json.loads(m.group(1)).get("known_trip_count", {}).get("n")
        except json.JSONDecodeError:
            n = None
    if n is None:
        raise ValueError(f"while loop {name}: XLA knows no trip count, so its FLOPs are unknown")
    return int(n)


def _local(lines: list[str]) -> tuple[float, list[tuple[tuple[str, ...], int]]]:
    """(FLOPs of this computation's own dots, [(callees, times called)]): one callee, or a
    conditional's branches, of which the dearest counts."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    flops, calls = 0.0, []
    for line in lines:
        parsed = _instruction(line)
        if parsed is None:
            continue
        name, type_, op, rest = parsed
        shapes[name] = _shape(type_)
        if op == "dot":
            lhs = rest.split(",", 1)[0].split()[-1].lstrip("%").rstrip(")")  # the first operand
            lhs_shape, dims = shapes.get(lhs), _CONTRACTING.search(rest)
            if lhs_shape is None or shapes[name] is None or dims is None:
                raise ValueError(f"dot {name}: cannot read its shapes from the HLO text")
            contracted = math.prod(lhs_shape[int(i)] for i in dims.group(1).split(",") if i)
            flops += 2.0 * math.prod(shapes[name]) * contracted
        elif op == "while":
            calls.append(((_BODY.search(rest).group(1),), _trip_count(line, name)))
        elif op == "conditional":
            # The most expensive branch: an upper bound on what one execution computes.
            listed = _BRANCHES.search(rest)
            branches = (
                [b.strip().lstrip("%") for b in listed.group(1).split(",")]
                if listed
                else _TRUE_FALSE.findall(rest)
            )
            calls.append((tuple(branches), 1))
        elif op == "custom-call" and _LIBRARY_PRODUCT.search(rest):
            raise ValueError(
                f"{name}: a library product (custom call), which this count does not read; "
                "it reads programs compiled for the CPU, whose products are dots"
            )
        else:
            # A fusion or a call runs its computation once; reducers' and comparators'
            # computations (`to_apply` of other ops) and loop conditions hold no products.
            calls.extend(((c,), 1) for c in _CALLS.findall(rest))
            if op == "call":
                calls.extend(((c,), 1) for c in _APPLIES.findall(rest))
    return flops, calls


def dot_flops(compiled) -> float:
    """Matrix-product FLOPs of one run of `compiled` (a `jax.stages.Compiled`), loops counted
    by their trip counts."""
    comps, entry = _computations(compiled.as_text())
    local = {name: _local(lines) for name, lines in comps.items()}
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            own, calls = local[name]
            memo[name] = own + sum(times * max(map(total, cs)) for cs, times in calls)
        return memo[name]

    return total(entry)
