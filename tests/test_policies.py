"""Cache policies as plug-ins: the protocol, the registry, KeyDiff against its NumPy reference,
and every built-in method in the engine (continuous batching, compiles, lanes, a mesh).

R-KV, SnapKV and StreamingLLM keep what they kept before the protocol: test_compression and
test_policy compare them with tests/reference/rkv_numpy.py, unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import sharding

import rkvjax
from rkvjax.entrypoints import cli
from rkvjax.kv import cache as kv
from rkvjax.kv import compress, policies
from rkvjax.kv import selection as C
from rkvjax.kv.config import CompressionConfig, compression_config
from rkvjax.runtime import programs
from tests import reference
from tests.limits import HANG_S
from tests.reference import keydiff_numpy
from tests.test_compression import SCORE_TOL, _inputs, _random_valid
from tests.test_policy import (
    _assert_layer0_replays,
    _full_qk,
    _load,
    _prompt,
    _ref_keep,
    _waiting_rows_run,
)
from tests.test_sharding import COLLECTIVES, _random_cache, sub_mesh

W = 8
BUDGET, BUFFER = 16, 8
BUILTINS = policies.BUILTINS


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama")[0])


@pytest.fixture(scope="module")
def options_of(stats_of):
    """method -> the options it needs on the tiny Llama (TriAttention: its statistics)."""
    return lambda method: {"calibration": stats_of("llama")} if method == "triattention" else {}


def _greedy(m: int) -> rkvjax.SamplingParams:
    return rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


# ---------------------------------------------------------------------------------------------
# 1. KeyDiff's keep sets against its NumPy reference, one compression step.


@pytest.mark.parametrize("n_q,k_heads", [(6, 3), (4, 4), (9, 3)])
@pytest.mark.parametrize("budget", [12, 24, 40])
def test_keydiff_matches_reference(n_q, k_heads, budget):
    q, k = _inputs(3, n_q=n_q, k_heads=k_heads)
    got = C.keep_indices("keydiff", jnp.asarray(q), jnp.asarray(k), budget=budget)
    np.testing.assert_array_equal(got, keydiff_numpy.keep(q, k, budget=budget))
    policy_ = policies.KeyDiff()
    score = policy_.scores(jnp.asarray(q), jnp.asarray(k), jnp.ones(k.shape[:3], bool))
    np.testing.assert_allclose(score, keydiff_numpy.scores(k, window=W), **SCORE_TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_keydiff_masked_equals_compacted(seed):
    """Keys that are not there take no part in the anchor and are never kept first: the result
    is KeyDiff on the present keys alone, mapped back."""
    rng = np.random.default_rng(40 + seed)
    q, k = _inputs(50 + seed, n_q=6, k_heads=3)
    n, budget = k.shape[2], 18
    kinds = ["left", "holes", "trailing", "few", "all"]
    counts = [[kinds[(b * 3 + kv + seed) % 5] for kv in range(3)] for b in range(2)]
    valid = _random_valid(rng, 3, n, counts)
    got = np.asarray(
        C.select("keydiff", jnp.asarray(q), jnp.asarray(k), jnp.asarray(valid), budget=budget)
    )
    for b in range(2):
        for h in range(3):
            idx = np.flatnonzero(valid[b, h])
            ck = k[b : b + 1, h : h + 1, idx]
            if len(idx) >= budget:
                want = idx[keydiff_numpy.keep(q[b : b + 1, :2], ck, budget=budget)[0, 0]]
                np.testing.assert_array_equal(got[b, h], want)
            else:
                kept = got[b, h]
                np.testing.assert_array_equal(kept[valid[b, h, kept]], idx)


def test_keydiff_keeps_the_outliers():
    """Keys along one common direction and a few orthogonal ones: the orthogonal ones are kept."""
    rng = np.random.default_rng(0)
    n, h = 40, 16
    base = rng.normal(size=h)
    k = base + 0.05 * rng.normal(size=(n, h))
    odd = [3, 11, 20]
    for i in odd:
        k[i] = rng.normal(size=h) - 2 * base
    keys = jnp.asarray(k[None, None], jnp.float32)  # [1, 1, n, H]
    got = C.keep_indices("keydiff", jnp.zeros((1, 1, W, h)), keys, budget=W + 3)
    assert got[0, 0, :3].tolist() == odd


# ---------------------------------------------------------------------------------------------
# 2. The protocol: building, checking, registering, options.


def test_registry_lists_the_builtins_and_builds_them():
    assert {"rkv", "snapkv", "streaming", "keydiff"} <= set(policies.names())
    assert policies.build("rkv", lam=0.3) == policies.RKV(lam=0.3)
    assert policies.build("streaming").options() == {"sinks": 4}
    cc = compression_config("rkv", 32, lam=0.3)
    assert cc.policy == policies.RKV(lam=0.3)
    assert cc.policy.options() == {"kernel": 7, "lam": 0.3, "threshold": 0.5, "retain": 1}
    assert CompressionConfig(method="snapkv", budget=16).policy == policies.SnapKV()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: policies.build("rkv", lamda=0.3), r"method 'rkv' has no option 'lamda' \(its"),
        (
            lambda: policies.build("keydiff", sinks=2),
            "'keydiff' has no option 'sinks' .it takes none",
        ),
        (lambda: policies.build("rkv", lam=2.0), r"lam must be in \[0, 1\]"),
        (lambda: policies.build("streaming", sinks=-1), "sinks must be an int >= 0"),
        (lambda: policies.build("lru"), "unknown method 'lru'; expected one of"),
        (lambda: compression_config("keydiff", 32, lam=1.5), r"lam must be in \[0, 1\]"),
        (lambda: compression_config("keydiff", 32, sinks=2), "'keydiff' has no option 'sinks'"),
        (lambda: compression_config("full", None, sinks=2), "method 'full' has no options"),
        (lambda: compression_config("rkv", 32, share="both"), "share must be one of none, heads"),
        (
            lambda: CompressionConfig(method="rkv", budget=16, policy=policies.SnapKV()),
            "is not method 'rkv'",
        ),
        (
            lambda: C.keep_indices(
                policies.RKV(), jnp.zeros((1, 2, 8, 4)), jnp.zeros((1, 2, 16, 4)), budget=9, lam=0.2
            ),
            "set them on the policy",
        ),
        (lambda: policies.parse_options("rkv", ["lam"]), "KEY=VALUE"),
        (lambda: policies.parse_options("rkv", ["kernel=1.5"]), "kernel must be int"),
        (
            lambda: policies.parse_options("rkv", ["lam=0.2", "lam=0.9"]),
            "option lam given twice .lam=0.2 and 'lam=0.9'.",
        ),
        # Another method's option with a value of its own would be silently ignored.
        (lambda: compression_config("full", None, lam=0.2), "method 'full' does not use lam=0.2"),
        (
            lambda: compression_config("snapkv", 32, threshold=0.9),
            "method 'snapkv' does not use threshold=0.9 .an R-KV option; its options:",
        ),
        # So would a method's own option without a budget (FullKV).
        (lambda: compression_config("rkv", None, lam=0.2), "lam=0.2 would be ignored: without a"),
        (lambda: compression_config("streaming", None, sinks=2), "sinks=2 would be ignored"),
    ],
)
def test_bad_policies_and_options_are_one_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rkv_options_at_their_defaults_pass_through_any_method():
    """The public signatures (`generate`, `keep_indices`) name R-KV's options for every method:
    at R-KV's defaults they change nothing anywhere, so they are accepted."""
    rkv = dict(kernel=7, lam=0.1, threshold=0.5, retain=1)
    assert compression_config("full", None, **rkv).method == "full"
    assert compression_config("snapkv", 32, **rkv).policy == policies.SnapKV()
    assert compression_config("rkv", None, **rkv).method == "full"


def test_parse_options_converts_to_the_field_types():
    got = policies.parse_options("rkv", ["lam=0.25", "kernel=5", "retain=2", "threshold=1"])
    assert got == {"lam": 0.25, "kernel": 5, "retain": 2, "threshold": 1.0}
    assert isinstance(got["kernel"], int) and isinstance(got["threshold"], float)


def test_register_refuses_what_cannot_be_a_static_policy():
    class Plain(policies.Policy):
        name = "plain"

    with pytest.raises(TypeError, match="frozen dataclass"):
        policies.register(Plain)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Bad(policies.Policy):
        name = "Bad Name"

    with pytest.raises(ValueError, match="lower-case name"):
        policies.register(Bad)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Clash(policies.Policy):
        name = "rkv"

    taken = r"'rkv' is already registered by rkvjax\.kv\.policies\.rkv\.RKV"
    with pytest.raises(ValueError, match=taken):
        policies.register(Clash)
    with pytest.raises(TypeError, match="Policy subclass"):
        policies.register(int)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Blind(policies.Policy):
        name = "blind"
        state = "attention"

    with pytest.raises(ValueError, match="keeps a state, which it reads from its context"):
        policies.register(Blind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyNorm(policies.Policy):
    """A test method: keys of small norm first (kvpress's KnormPress), scaled by `sign`."""

    name = "test-keynorm"
    sign: float = -1.0

    def check(self):
        if self.sign not in (-1.0, 1.0):
            raise ValueError(f"sign must be 1 or -1, got {self.sign}")

    def scores(self, queries, keys, valid, *, impl=None, target=None):
        w = queries.shape[2]
        norm = jnp.linalg.norm(keys.astype(jnp.float32), axis=-1)  # [B, K, n]
        return self.sign * norm[..., : keys.shape[2] - w]


@pytest.fixture
def keynorm():
    policies.register(KeyNorm)
    yield KeyNorm
    policies.unregister(KeyNorm.name)


def _keynorm_reference(queries, keys, *, budget, sign=-1.0):
    n = keys.shape[2]
    score = sign * np.linalg.norm(np.float64(keys), axis=-1)[..., : n - W]
    return keydiff_numpy.keep_by_scores(score, budget=budget, window=W, n=n)


def test_a_registered_method_runs_everywhere_a_method_is_taken(llama, keynorm, tmp_path, capsys):
    """A method defined outside the engine: its options are checked, the engine's prefill and
    decode compressions keep what its reference keeps, and the command line takes it."""
    with pytest.raises(ValueError, match="sign must be 1 or -1"):
        compression_config("test-keynorm", 16, sign=0.5)
    prompts = [_prompt(30, 1), _prompt(11, 2)]
    outs = rkvjax.generate(
        llama,
        prompts,
        method="test-keynorm",
        sign=1.0,
        budget=BUDGET,
        buffer=BUFFER,
        max_new_tokens=30,
        record_kept=True,
    )
    _, ks = _full_qk(llama, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)], 64)
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.stats.compressions >= 2
        n = len(p) if len(p) > BUDGET else BUDGET + BUFFER  # held at the first compression
        # From layer 1: at layer 0 a key's norm depends only on its token (RoPE rotates), so a
        # repeated token ties exactly with itself and float32 breaks the tie either way.
        for layer in range(1, len(ks)):
            k = ks[layer][r][:n]  # [n, K, H]
            want = _keynorm_reference(None, np.swapaxes(k, 0, 1)[None], budget=BUDGET, sign=1.0)
            np.testing.assert_array_equal(out.kept_positions[0, layer], want[0])
    # The command line: the method by name, its options as KEY=VALUE, recorded in the header.
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": prompts[0]}) + "\n")
    flags = ["--model", str(llama.path), "--method", "test-keynorm", "--budget", "16"]
    flags += ["--buffer", "8", "--max-tokens", "30", "--ignore-eos", "--token-ids"]
    assert cli.main(["batch", str(src), str(dst), *flags, "--method-arg", "sign=1"]) == 0
    header, line = map(json.loads, dst.read_text().splitlines()[:2])
    assert header["settings"]["method"] == "test-keynorm" and header["settings"]["sign"] == 1.0
    assert line["token_ids"] == outs[0].token_ids
    assert cli.main(["batch", str(src), str(tmp_path / "b.jsonl"), *flags, "--method-arg", "x=1"])
    err = capsys.readouterr().err
    assert "method 'test-keynorm' has no option 'x' (its options: sign)" in err


# ---------------------------------------------------------------------------------------------
# 3. KeyDiff in the engine: every compression against the reference, every architecture.


@pytest.mark.parametrize("kind", ["llama", "qwen2_gqa3", "qwen3"])
@pytest.mark.parametrize("budget", [20, 28])
def test_keydiff_prefill_compression_matches_reference(tiny_checkpoint, kind, budget):
    model = _load(tiny_checkpoint(kind)[0])
    lengths = (40, 52)
    prompts = [_prompt(n, seed=7 + n) for n in lengths]
    outs = rkvjax.generate(
        model, prompts, method="keydiff", budget=budget, max_new_tokens=1, record_kept=True
    )
    qs, ks = _full_qk(model, prompts, max(lengths))
    for r, (n, out) in enumerate(zip(lengths, outs, strict=True)):
        assert out.stats.compressions == 1
        held = [list(range(n))] * model.config.kv_heads
        for layer in range(model.config.num_layers):
            want = _ref_keep("keydiff", qs[layer][r], ks[layer][r], held, budget=budget)
            np.testing.assert_array_equal(
                out.kept_positions[0, layer], want, err_msg=f"{r} {layer}"
            )


@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming", "keydiff"])
def test_decode_compressions_match_reference_with_waiting_rows(llama, method):
    """Ragged rows (one compressed at prefill) and four rows of one length that fill on the same
    step with one lane, so three wait: every layer-0 compression replayed, every layer at the
    first, and each row's tokens and keep sets as alone."""
    lengths = (9, 14, 30, 11, 11, 11, 11)
    prompts = [_prompt(n, seed=500 + i) for i, n in enumerate(lengths)]
    cc = compression_config(method, BUDGET, buffer=BUFFER)
    got = _waiting_rows_run(llama, cc, prompts, [_greedy(50)] * len(prompts))
    qs, ks = _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, got, strict=True)], 80)
    _assert_layer0_replays(method, prompts, got, qs, ks, budget=BUDGET, buffer=BUFFER)
    for r, (p, res) in enumerate(zip(prompts, got, strict=True)):
        n = len(p) if len(p) > BUDGET else BUDGET + BUFFER
        held = [list(range(n))] * ks[0].shape[2]
        for layer in range(len(ks)):
            first = _ref_keep(method, qs[layer][r], ks[layer][r], held, budget=BUDGET)
            np.testing.assert_array_equal(res.kept_positions[0, layer], first)


# ---------------------------------------------------------------------------------------------
# 4. Every built-in method: continuous batching, compiles, a mesh.


@pytest.mark.parametrize("method", BUILTINS)
def test_continuous_batching_gives_each_request_alone_without_recompiling(
    llama, method, options_of
):
    """Six requests through two slots (admissions into freed rows, compressions in both): each
    request's tokens and keep sets are those of the request alone, and the whole run traces
    init, insert and decode once and prefill once per prompt bucket."""
    opts = options_of(method)
    cc = compression_config(method, BUDGET, buffer=BUFFER, window=6, **opts)  # a plan of its own
    prompts = [_prompt(n, seed=600 + n) for n in (10, 21, 9, 15, 12, 30)]
    # Seeded: random eviction draws from the request's seed (an unseeded request gets a fresh one).
    params = [dataclasses.replace(_greedy(m), seed=m) for m in (30, 12, 40, 20, 25, 33)]
    eng = rkvjax.Engine(llama, slots=2, cache=cc, max_prefill_rows=1, record_kept=True)
    before = collections.Counter(programs.TRACES)
    eng.submit_many(prompts, params)
    got = sorted(eng.run(), key=lambda r: r.request_id)  # run() yields in finish order
    traced = collections.Counter(programs.TRACES) - before
    # One prefill per prompt bucket (16 and 32: the 21- and 30-token prompts compress there).
    assert traced == collections.Counter(init_state=1, prefill=2, insert=1, decode=1)
    assert sum(r.stats.compressions for r in got) >= 10
    for p, sp, res in zip(prompts, params, got, strict=True):
        one = rkvjax.Engine(llama, slots=1, cache=cc, record_kept=True)
        one.submit(p, sp)
        (ref,) = one.run()
        assert res.token_ids == ref.token_ids
        np.testing.assert_array_equal(res.kept_positions, ref.kept_positions)


@pytest.mark.parametrize("method", BUILTINS)
def test_compression_adds_no_collectives_on_a_mesh(method, options_of):
    """Each method's compression runs per device under shard_map (rows and KV heads stay where
    they are): no collective, and the same caches as without the mesh."""
    mesh, rules = sub_mesh(4, 2), sharding.DEFAULT_RULES
    built = policies.build(method, **options_of(method))
    cc = CompressionConfig(method=method, budget=16, buffer=8, window=8, policy=built)
    rs = np.random.RandomState(1)
    cache = _random_cache(rs)
    cache = dataclasses.replace(
        cache,
        prompt=jnp.asarray([3, 9, 0, 30], jnp.int32),
        seed=jnp.asarray([5, 6, 7, 8], jnp.uint32),
    )
    if cc.state is not None:
        acc = tuple(jnp.asarray(rs.uniform(size=sp.shape), jnp.float32) for sp in cache.slot_pos)
        cache = dataclasses.replace(cache, acc=acc)
    rows = jnp.array([True, True, False, True])
    start = jnp.int32(0)
    with jax.set_mesh(mesh):
        sharded = jax.jit(lambda c: kv.constrain(c, rules))(cache)
        local = jax.jit(
            lambda c, r: compress.compress_lanes(c, r, cc, lanes=1, start=start, rules=rules)
        )
        local = local.lower(sharded, rows).compile()
        got = local(sharded, rows)
    want = jax.jit(lambda c, r: compress.compress_lanes(c, r, cc, lanes=4, start=start))(
        cache, rows
    )
    ops = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", local.as_text())
    assert not ops, ops
    # The same kept slots; a state computed by the method (G-KV's) to float32 rounding, as the
    # one-lane and four-lane blocks are different programs.
    for a, b in zip(got[0].acc, want[0].acc, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    exact = (dataclasses.replace(x, acc=()) for x in (got[0], want[0]))
    for a, b in zip(*map(jax.tree.leaves, exact), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("method, budget", [("keydiff", 16), ("triattention", 24)])
def test_on_a_data_x_model_mesh_equals_one_device(tiny_checkpoint, options_of, method, budget):
    """Rows on "data", KV heads with their query heads on "model": each device scores its own
    heads (TriAttention with those heads' own statistics), and keeps what one device keeps."""
    folder = tiny_checkpoint("llama")[0]
    prompts = [_prompt(n, seed=700 + n) for n in (9, 20, 33)]
    kw = dict(method=method, budget=budget, buffer=8, max_new_tokens=40, record_kept=True)
    kw.update(options_of(method))
    want = rkvjax.generate(_load(folder), prompts, **kw)
    sharded = rkvjax.load(folder, dtype="float32", mesh=sub_mesh(2, 2))
    got = rkvjax.generate(sharded, prompts, **kw)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.stats.compressions == w.stats.compressions >= 2  # decode (and prompt)
        np.testing.assert_array_equal(g.kept_positions, w.kept_positions)


def test_reference_dispatch_knows_every_builtin():
    """Every built-in method without a decoding state has an independent NumPy reference
    (tests/reference) that `keep_indices` equals; one with a state is one clear error there."""
    q, k = _inputs(9, n_q=4, k_heads=2)
    for method in BUILTINS:
        if "calibration" in policies.option_names(method):
            continue  # statistics of a model: tests/test_triattention.py
        if policies.get(method).state is not None:
            with pytest.raises(ValueError, match=f"method '{method}' .*a state only the engine"):
                C.keep_indices(method, jnp.asarray(q), jnp.asarray(k), budget=20)
            continue
        got = C.keep_indices(method, jnp.asarray(q), jnp.asarray(k), budget=20)
        np.testing.assert_array_equal(got, reference.keep(method, q, k, budget=20))


# ---------------------------------------------------------------------------------------------
# 5. The README's example of a method of one's own, as written there.

ROOT = Path(__file__).resolve().parents[1]


def _readme_example() -> tuple[str, list[str]]:
    """The README's example: its Python file and its shell commands (continuations joined)."""
    section = (ROOT / "README.md").read_text().split("### A method of your own", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shell = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    lines = [line.split("#", 1)[0].strip() for line in shell.splitlines()]
    return code, [line for line in lines if line]


@pytest.mark.slow
def test_the_readme_policy_example_runs(smol_dir, tmp_path):
    """The file runs (the default model generates under the new method, which compresses);
    the command line and the benchmark suite find it through $RKVJAX_POLICIES. The bench runs
    its --tiny variant (the README's run is minutes on a CPU)."""
    code, commands = _readme_example()
    assert len(commands) == 3, commands
    (tmp_path / "keynorm.py").write_text(code)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    env.pop(policies.PLUGINS_ENV, None)
    outputs = []
    for command in commands:
        cwd = tmp_path
        if "-m bench" in command:
            command = command.replace("/path/to/keynorm/folder", shlex.quote(str(tmp_path)))
            command += f" --tiny --out {shlex.quote(str(tmp_path / 'bench'))}"
            cwd = ROOT
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-3000:])
        outputs.append(done)
    compressions = int(outputs[0].stdout.split()[0])
    assert compressions >= 1, outputs[0].stdout
    rows = (tmp_path / "bench" / "fidelity" / "results.jsonl").read_text().splitlines()
    assert {"keynorm", "rkv"} <= {json.loads(r)["method"] for r in rows}


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (None, "No module named 'broken_policy'"),
        ("def scores(:\n", "SyntaxError: invalid syntax \\(.*broken_policy.py, line 1\\)"),
        ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ],
)
def test_a_plugin_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys, code, why):
    """A missing module, a syntax error or an exception in $RKVJAX_POLICIES: one line naming
    the variable and the module for every command that takes a method, none for `merge`."""
    if code is not None:
        (tmp_path / "broken_policy.py").write_text(code)
        monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(policies.PLUGINS_ENV, "broken_policy")
    monkeypatch.setattr(policies.base, "_plugins_loaded", False)
    monkeypatch.setattr(policies.base, "_plugin_error", None)
    for argv in (["generate", "x"], ["batch", "in.jsonl", "out.jsonl"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(
            f"rkvjax: error: \\$RKVJAX_POLICIES: cannot import 'broken_policy': {why}\n", err
        ), err
    assert cli.main(["merge", str(tmp_path / "m.jsonl"), str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "RKVJAX_POLICIES" not in err and "none.jsonl: no such file" in err


# ---------------------------------------------------------------------------------------------
# 6. Kept sets shared over heads, layers or both.


def _shared_reference(method, qs, ks, r, n, *, budget, share):
    """[L, K, budget] kept positions of row r holding its first n tokens, the method's NumPy
    scores summed over layers ("layers", "all") and averaged over KV heads ("heads", "all")."""
    layers_, kh = len(ks), ks[0].shape[2]
    g = qs[0].shape[2] // kh
    score = np.zeros((layers_, kh, n - W))
    for layer in range(layers_):
        q, k = qs[layer][r][:n], ks[layer][r][:n]  # [n, N, H], [n, K, H]
        for h in range(kh):
            queries = np.swapaxes(q[n - W :, h * g : (h + 1) * g], 0, 1)[None]  # [1, G, W, H]
            keys = k[:, h][None, None]  # [1, 1, n, H]
            if method == "rkv":
                score[layer, h] = reference.rkv_numpy.rkv_scores(queries, keys)[0, 0]
            else:
                score[layer, h] = keydiff_numpy.scores(keys, window=W)[0, 0]
    if share in ("layers", "all"):
        score = np.broadcast_to(score.sum(0, keepdims=True), score.shape)
    if share in ("heads", "all"):
        score = np.broadcast_to(score.mean(1, keepdims=True), score.shape)
    return keydiff_numpy.keep_by_scores(score, budget=budget, window=W, n=n)


@pytest.mark.parametrize("share", ["heads", "layers", "all"])
@pytest.mark.parametrize("method", ["rkv", "keydiff"])
def test_shared_kept_sets_match_reference(llama, method, share):
    """The prompt's compression (a 30-token prompt) and the first decode compression of a short
    one (9 tokens, at budget + buffer): the kept sets are shared as asked and equal the
    reference over the combined scores; each row as alone."""
    prompts = [_prompt(30, 31), _prompt(9, 32)]
    kw = dict(method=method, budget=BUDGET, buffer=BUFFER, share=share, record_kept=True)
    outs = rkvjax.generate(llama, prompts, max_new_tokens=30, **kw)
    qs, ks = _full_qk(llama, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)], 64)
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.stats.compressions >= 2
        kept = out.kept_positions  # [E, L, K, budget]
        if share in ("layers", "all"):
            assert (kept == kept[:, :1]).all()
        if share in ("heads", "all"):
            assert (kept == kept[:, :, :1]).all()
        n = len(p) if len(p) > BUDGET else BUDGET + BUFFER
        want = _shared_reference(method, qs, ks, r, n, budget=BUDGET, share=share)
        np.testing.assert_array_equal(kept[0], want, err_msg=f"row {r}")
        (alone,) = [rkvjax.generate(llama, [p], max_new_tokens=30, **kw)[0]]
        assert alone.token_ids == out.token_ids
        np.testing.assert_array_equal(alone.kept_positions, kept)


_MESH_SHARE = """
import sys

import numpy as np

import rkvjax
from tests.test_policy import _prompt
from tests.test_sharding import sub_mesh

folder = sys.argv[1]
prompts = [_prompt(n, seed=800 + n) for n in (9, 20, 33)]
kw = dict(method="rkv", budget=16, buffer=8, max_new_tokens=40, share="all", record_kept=True)
want = rkvjax.generate(rkvjax.load(folder, dtype="float32"), prompts, **kw)
got = rkvjax.generate(rkvjax.load(folder, dtype="float32", mesh=sub_mesh(2, 2)), prompts, **kw)
for g, w in zip(got, want, strict=True):
    assert g.token_ids == w.token_ids
    assert g.stats.compressions == w.stats.compressions >= 2
    np.testing.assert_array_equal(g.kept_positions, w.kept_positions)
print("ok")
"""


def test_shared_kept_sets_on_a_mesh_equal_one_device(tiny_checkpoint):
    """Heads split over the model axis: the average over heads gathers them, exactly.

    In a process of its own, so that it starts with few memory mappings (see conftest's
    `_free_compiled_programs`: late in a worker, XLA:CPU crashed compiling this run)."""
    folder = tiny_checkpoint("llama")[0]
    done = subprocess.run(
        [sys.executable, "-c", _MESH_SHARE, str(folder)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
