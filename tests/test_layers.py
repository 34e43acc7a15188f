"""The package's layers: each module imports only modules of its own layer or the layers below
it, and no module imports itself back through others. Imports inside functions count (they
run, late, all the same); `if TYPE_CHECKING:` blocks do not. Read from the source's syntax
tree, so the test needs no import of the package and names the file and line of a violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's source lies (pyproject's package-dir).
SOURCES = {
    "rkvjax": ROOT / "rkvjax",
    "rkvjax.models": ROOT / "models",
    "rkvjax.convert": ROOT / "convert",
}

# Lowest first: each a folder (or, at the bottom and top, a few modules of the package root). A
# module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "rkvjax.defaults",
            "rkvjax.checks",
            "rkvjax.xla_flags",
            "rkvjax.allocator",
            "rkvjax.lazy",
            "rkvjax.home",
        ),
    ),
    ("text", ("rkvjax.text",)),
    ("model", ("rkvjax.models", "rkvjax.convert")),
    ("sampling", ("rkvjax.sampling",)),
    ("kv cache", ("rkvjax.kv",)),
    ("runtime", ("rkvjax.runtime",)),
    ("api", ("rkvjax.api",)),
    ("entrypoints", ("rkvjax.entrypoints",)),
    # The package's lazy public names, the public aliases `rkvjax.compression` and
    # `rkvjax.policies` (nothing inside the package imports them), and `python -m rkvjax`.
    ("package", ("rkvjax", "rkvjax.compression", "rkvjax.policies", "rkvjax.__main__")),
)


def modules() -> dict[str, Path]:
    out = {}
    for package, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the package, line) for every import of `name`'s source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node):
        if isinstance(node, ast.If) and _type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from rkvjax import api` imports the module rkvjax.api
                sub = f"{base}.{a.name}"
                found.append((sub if sub in known else base, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(m, line) for m, line in found if m in known]


def layer_of(module: str) -> int | None:
    """The layer of `module` (None: it has none). The package's own name holds only its
    `__init__`: a module added at the root needs a layer of its own choosing."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "rkvjax"
            if (module == p or inside) and len(p) > length:
                best, length = i, len(p)
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), and self-imports."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_every_module_has_a_layer():
    missing = [m for m in modules() if layer_of(m) is None]
    assert not missing, f"give these modules a layer in tests/test_layers.py LAYERS: {missing}"


def test_imports_go_down_the_layers():
    known = modules()
    up = []
    for name, path in known.items():
        mine = layer_of(name)
        for target, line in imports(name, path, known):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(
                    f"{path.relative_to(ROOT)}:{line}: {name} ({LAYERS[mine][0]}) imports "
                    f"{target} ({LAYERS[theirs][0]})"
                )
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_no_import_cycle():
    known = modules()
    graph = {n: {t for t, _ in imports(n, p, known)} - {"rkvjax"} for n, p in known.items()}
    graph["rkvjax"] = {t for t, _ in imports("rkvjax", known["rkvjax"], known)}
    found = cycles(graph)
    assert not found, f"import cycles: {found}"


def test_the_check_sees_function_level_imports_and_cycles(tmp_path):
    """The checks can fail: a function-level import up the layers and a two-module cycle are
    found; a TYPE_CHECKING import is not counted."""
    src = tmp_path / "pkg"
    src.mkdir()
    (src / "__init__.py").write_text("")
    (src / "a.py").write_text("def f():\n    from pkg import b\n")
    (src / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nimport pkg.a\n"
    )
    (src / "c.py").write_text("")
    known = {"pkg": src / "__init__.py", **{f"pkg.{m}": src / f"{m}.py" for m in "abc"}}
    assert imports("pkg.a", known["pkg.a"], known) == [("pkg.b", 2)]
    assert imports("pkg.b", known["pkg.b"], known) == [("pkg.a", 4)]
    graph = {n: {t for t, _ in imports(n, p, known)} for n, p in known.items()}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_public_paths_still_answer():
    """The names outside code calls keep working where the layers moved their code."""
    from rkvjax.convert.hf_config import parse_hf_config
    from rkvjax.models import sharding
    from rkvjax.models.decoder import abstract_decoder

    import rkvjax
    from rkvjax.compression import keep_indices
    from rkvjax.entrypoints import jobs
    from rkvjax.kv import policies, selection
    from rkvjax.policies import Policy, names, register

    assert keep_indices is selection.keep_indices is rkvjax.compression.keep_indices
    assert (names, register, Policy) == (policies.names, policies.register, policies.Policy)
    assert rkvjax.policies.names() == policies.names()
    assert rkvjax.jobs.run_job is jobs.run_job and rkvjax.sharding.make_mesh is sharding.make_mesh
    assert callable(parse_hf_config) and callable(abstract_decoder)
    assert callable(rkvjax.compression_config) and callable(rkvjax.load)
