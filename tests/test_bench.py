"""The benchmark suite: every suite's tiny variant end to end, and the shared helpers."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import rkvjax
from bench import checkpoints, common
from bench.__main__ import SUITES, parse_args

ROOT = Path(__file__).resolve().parents[1]


def _files(folder: Path) -> dict[str, int]:
    return {str(f.relative_to(folder)): f.stat().st_size for f in folder.rglob("*") if f.is_file()}


def test_every_tiny_suite_writes_rows_table_and_plot(tmp_path, shared_data):
    """`python -m bench all --tiny` from a shell: every suite writes its rows, table and plot
    into --out and leaves the recorded results alone. (The suites read their prompts and the
    paper-shape configs from the shared data.)"""
    history = _files(common.RESULTS)
    out = tmp_path / "results"
    # Not this process's XLA_FLAGS (8 host devices for the sharding tests): the suite sets its
    # own, as it would from a shell.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", RKVJAX_COMPILE_CACHE="0")
    run = subprocess.run(
        [sys.executable, "-m", "bench", "all", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3 * 3600,  # a guard against a hang only: it takes about 2 minutes
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    plots = importlib.util.find_spec("matplotlib") is not None
    for suite in SUITES:
        folder = out / suite
        rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
        assert rows, suite
        assert all(r["bench"] and r["argv"][0] == "all" for r in rows), suite
        assert "|---" in (folder / "table.md").read_text(), suite
        assert (folder / "plot.png").is_file() == plots, suite
    assert _files(common.RESULTS) == history  # smoke runs leave the recorded results alone


def test_parse_args_suite_options_and_tiny_defaults():
    args, suites = parse_args(["jobs", "--repeats", "3"])
    assert list(suites) == ["jobs"] and suites["jobs"].repeats == 3
    assert suites["jobs"].slots == 16 and not args.tiny  # the full-size default
    _, suites = parse_args(["all", "--tiny"])
    assert list(suites) == list(SUITES)
    assert suites["decode"].batch == [1] and suites["memory"].methods == ["rkv"]
    # An option given on the command line wins over the tiny default.
    _, suites = parse_args(["memory", "--tiny", "--methods", "full"])
    assert suites["memory"].methods == ["full"] and suites["memory"].contexts == [256]
    with pytest.raises(SystemExit):
        parse_args(["decode", "memory", "--batch", "4"])  # suite options need one suite


def _gpu_steps(script: str) -> dict[str, tuple[str, list[str]]]:
    """{case label: (the log it names, its command's words)} of gpu_suite.sh's `run_step`."""
    body = script.split("run_step() {", 1)[1].split("esac", 1)[0].replace("\\\n", " ")
    steps = {}
    for line in body.splitlines():
        m = re.fullmatch(r"\s*(\w+)\) step (\w+) \d+ (.*) ;;", line)
        if m:
            steps[m[1]] = (m[2], shlex.split(m[3]))
    return steps


def test_gpu_suite_commands_parse(tmp_path):
    """Every step of bench/gpu_suite.sh parses with the options its program has today, and
    the default pass names only steps it has: a renamed flag fails here, on CPU, not in the
    few minutes of a GPU run."""
    script = (ROOT / "bench" / "gpu_suite.sh").read_text()
    steps = _gpu_steps(script)
    body = script.split("run_step() {", 1)[1].split("esac", 1)[0]
    labels = re.findall(r"^\t(\w+)\)", body, re.M)  # every case but `*)`
    assert len(labels) > 5 and set(steps) == set(labels)
    default = re.search(r"\|\| steps=\((.*)\)", script)[1].split()
    assert default and set(default) <= set(steps)
    # One GPU command may run 10 minutes, start-up and a rerun's margin included: the default
    # pass fits in 7 by its own limits, most important step first.
    limits = {m[1]: int(m[2]) for m in re.finditer(r"^\t(\w+)\) step \w+ (\d+) ", body, re.M)}
    assert sum(limits[s] for s in default) <= 7 * 60, {s: limits[s] for s in default}
    assert default[:5] == ["tests", "scale", "kernel", "kv_int8", "host"]
    for label, (log, words) in steps.items():
        assert log == label
        while words[0] == "env" or "=" in words[0]:
            words = words[1:]
        assert words[:2] == ["$py", "-m"], label
        sub = {"$out": str(tmp_path), "$ckpt": str(tmp_path / "ckpt")}
        words = [sub.get(w, w) for w in words[2:]]
        program, argv = words[0], words[1:]
        if program == "pytest":
            files = [w for w in argv if w.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f in files), label
        elif program == "bench":
            _, suites = parse_args(argv)  # argparse exits (SystemExit) on a bad flag
            assert len(suites) == 1, label
        else:
            assert program == "bench.checkpoints", label
            checkpoints.parser().parse_args(argv)


def test_markdown_table_and_timings():
    rows = [{"a": 1.234, "b": None}, {"a": 10.0}]
    columns = [("A", "a", ".1f"), ("B", "b", "d"), ("2A", lambda r: 2 * r["a"], ".0f")]
    assert common.markdown_table(rows, columns).splitlines() == [
        "| A | B | 2A |",
        "|---|---|---|",
        "| 1.2 | - | 2 |",
        "| 10.0 | - | 20 |",
    ]
    calls = []
    times = common.timings(lambda: calls.append(1), 4, warmup=3)
    assert len(times) == 4 and len(calls) == 7
    calls.clear()
    # A spent budget stops the timing at the minimum number of calls.
    times = common.timings(lambda: calls.append(1), 50, warmup=1, budget_s=0.0, min_repeats=5)
    assert len(times) == 5 and len(calls) == 6
    assert [list(r) for r in common.rotations("abc", 4)] == [
        list("abc"),
        list("bca"),
        list("cab"),
        list("abc"),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_byte_counts_match_the_engine(tmp_path, dtype):
    """kv_bytes is the engine's own cache layout (bfloat16 stored as uint16; an 8-bit cache's
    codes and float32 scales) and weight_bytes the checkpoint's tensors (the tied embedding
    once)."""
    from safetensors.numpy import load_file

    folder = checkpoints.save("tiny", tmp_path / "tiny", dtype=dtype)
    model = rkvjax.load(folder, dtype=dtype)
    itemsize = jnp.dtype(dtype).itemsize
    tensors = load_file(folder / "model.safetensors")
    assert common.weight_bytes(model) == sum(t.nbytes for t in tensors.values())
    for kv_dtype in [None, "int8", "float8_e4m3fn"]:
        rkv = rkvjax.compression_config("rkv", 32, buffer=16, kv_dtype=kv_dtype)
        full = rkvjax.compression_config("full", kv_dtype=kv_dtype)
        stored = common.kv_dtype_name(kv_dtype, dtype)
        for cc, capacity in [(rkv, 48), (full, 40)]:
            eng = rkvjax.Engine(model, slots=3, cache=cc, max_len=capacity)
            cache = eng.state_shapes().cache
            assert eng.capacity == capacity
            kv = common.tree_bytes((cache.k, cache.v, cache.k_scale, cache.v_scale))
            assert common.kv_bytes(model.config, 3, capacity, stored) == kv
            if kv_dtype is None:  # a float cache's count from its itemsize, as decode gives it
                assert common.kv_bytes(model.config, 3, capacity, itemsize) == kv
            with_positions = kv + common.tree_bytes(cache.slot_pos)
            assert (
                common.kv_bytes(model.config, 3, capacity, stored, positions=True) == with_positions
            )
            assert common.cache_bytes(cache) == with_positions
            ring = common.tree_bytes((cache.q_win, cache.q_scale))
            assert (ring > 0) == cc.compressing
            assert common.cache_bytes(cache, queries=True) == with_positions + ring


def test_capacity_and_memory_set_kv_dtypes_side_by_side(tmp_path):
    """--kv-dtype runs each setting once per storage type: an int8 row (one-byte codes and a
    float32 scale per token and head) holds 0.58x a bfloat16 one at the tiny model's head_dim
    of 32 (0.52x at 128), more rows fit, and the tables set the types side by side."""
    from bench import capacity, memory

    _, suites = parse_args(["capacity", "--tiny", "--kv-dtype", "bfloat16", "int8"])
    rows = capacity.run(suites["capacity"], tmp_path / "capacity")
    bf16, int8 = rows
    assert (bf16["kv_dtype"], int8["kv_dtype"]) == ("bfloat16", "int8")
    assert int8["kv_bytes_per_row"] <= 0.6 * bf16["kv_bytes_per_row"]
    assert int8["peak_bytes_per_row"] < bf16["peak_bytes_per_row"]
    assert int8["max_batch"] > bf16["max_batch"] and int8["max_batch_checked"]
    assert "| max batch bf16 | max batch int8 | batch int8 / bf16 |" in capacity.table(rows)

    argv = ["memory", "--tiny", "--methods", "full", "--kv-dtype", "bfloat16", "int8"]
    _, suites = parse_args([*argv, "--skip-capacity", "--repeats", "1"])
    args = suites["memory"]
    model, _ = common.load_model(args)
    meta = common.run_meta(model=common.TINY_MODEL_NAME, dtype="float32")
    bf16, int8 = memory.speed_rows(model, args, meta, tmp_path / "memory")
    assert (bf16["kv_dtype"], int8["kv_dtype"]) == ("bfloat16", "int8")
    assert int8["cache_kv_bytes"] <= 0.6 * bf16["cache_kv_bytes"]
    assert int8["kv_dtype_ref"] == "bfloat16" and int8["speedup_vs_kv_dtype_ref"] > 0
    assert "x bf16" in memory.table([bf16, int8])


def test_random_init_and_a_filled_cache():
    """The scale suite's model has the checkpoint's shapes; its filled cache keeps the cache's
    invariant, and R-KV compresses every row on the next decode chunk."""
    import jax
    import numpy as np
    from rkvjax.models import loading

    from bench import scale
    from rkvjax.runtime import programs

    config = common.tiny_checkpoint() / "config.json"
    model = loading.random_init(config, dtype="float32")
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(model.decoder)]
    assert shapes == [
        (x.shape, x.dtype)
        for x in jax.tree.leaves(loading.abstract(config, dtype="float32").decoder)
    ]
    assert np.std(np.asarray(model.decoder.embed[...])) > 0.01
    cc = rkvjax.compression_config("rkv", 24, buffer=8)
    eng = rkvjax.Engine(model, slots=2, cache=cc)
    sp = rkvjax.SamplingParams(max_tokens=64, ignore_eos=True)
    eng.submit_many([list(range(3, 13)), list(range(20, 34))], [sp, sp])
    state = scale.filled(eng.prefilled(), eng.capacity - 1)
    pos = np.asarray(state.cache.slot_pos[1])  # [B, K, C]
    want = np.where(np.arange(eng.capacity) < eng.capacity - 1, np.arange(eng.capacity), -1)
    assert (pos == want).all() and (np.asarray(state.cache.length) == eng.capacity - 1).all()
    before = np.asarray(state.compressions)
    state, _ = programs.decode(model.decoder, state, steps=eng.chunk, plan=eng.plan)
    assert (np.asarray(state.compressions) > before).all()
    assert (np.asarray(state.cache.length) < eng.capacity).all()


def test_scale_rows_say_why_a_setting_has_no_number(tmp_path, monkeypatch):
    """A setting that fails is a row with its error, and the R-KV row at FullKV's batch, with
    no FullKV batch to match, is a row that says so: the table has a line per setting."""
    from bench import scale

    def measured(model, cc, batch, gen, args):
        if not cc.compressing:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return {"batch": batch, "step_ms": 1.0, "tokens_per_s": 100.0 * batch}

    monkeypatch.setattr(scale, "_measured", measured)
    _, suites = parse_args(["scale", "--tiny", "--gen-tokens", "96"])
    args = suites["scale"]
    args.tiny = False  # a tiny run raises on the first failure instead
    rows = scale.run(args, tmp_path)
    by = {r["setting"]: r for r in rows}
    assert list(by) == ["full", "rkv-24", "rkv-24@full-batch"]
    assert "RESOURCE_EXHAUSTED" in by["full"]["error"] and "tokens_per_s" not in by["full"]
    assert by["rkv-24@full-batch"]["skipped"] == "no FullKV batch to match"
    assert by["rkv-24"]["tokens_per_s"] > 0 and by["rkv-24"]["vs_full"] is None
    text = scale.table(rows)
    assert "RuntimeError" in text and "skipped: no FullKV batch to match" in text


def test_scale_runs_each_setting_per_kv_dtype(tmp_path, monkeypatch):
    """Each setting once per storage type, types innermost, each at its own largest batch;
    R-KV at FullKV's batch takes FullKV's batch of the same type, and x FullKV compares
    within a type."""
    from bench import scale

    def measured(model, cc, batch, gen, args):
        return {"batch": batch, "step_ms": 1.0, "tokens_per_s": 100.0 * batch}

    monkeypatch.setattr(scale, "_measured", measured)
    argv = ["scale", "--tiny", "--gen-tokens", "96", "--max-batch", "4096"]
    argv += ["--kv-dtype", "float32", "int8"]
    _, suites = parse_args(argv)
    rows = scale.run(suites["scale"], tmp_path)
    got = [(r["setting"], r["kv_dtype"]) for r in rows]
    assert got == [
        (setting, kv)
        for setting in ["full", "rkv-24", "rkv-24@full-batch"]
        for kv in ["float32", "int8"]
    ]
    by = {(r["setting"], r["kv_dtype"]): r for r in rows}
    f32, int8 = by["full", "float32"], by["full", "int8"]
    assert int8["row_bytes"] < 0.5 * f32["row_bytes"] and int8["batch"] > f32["batch"]
    for kv in ["float32", "int8"]:
        assert by["rkv-24@full-batch", kv]["batch"] == by["full", kv]["batch"]
        assert by["full", kv]["vs_full"] == 1.0
    assert "| kv dtype |" in scale.table(rows)
    _, suites = parse_args([*argv, "--methods", "full"])
    assert [label for label, _, _ in scale.plan(suites["scale"], 96)] == ["full", "full"]
