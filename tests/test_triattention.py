"""TriAttention: the calibration statistics, the keep sets against the float64 NumPy reference
(tests/reference/triattention_numpy.py, which rotates each key back with its position: the
authors' form) in one step, in the engine's prefill and decode compressions and on a mesh, the
errors, and `rkvjax calibrate` on the command line.

Statistics files are written by `calibrate` from the tiny random checkpoints, or made up for
random inputs; both are written to the tests' temporary folders.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import layers

import rkvjax
from rkvjax.entrypoints import calibration, cli, evaluation
from rkvjax.entrypoints.cli import flags
from rkvjax.kv import policies
from rkvjax.kv import selection as C
from rkvjax.kv.config import compression_config
from rkvjax.kv.policies import triattention_stats
from tests.conftest import CALIBRATION_LENGTHS
from tests.reference import triattention_numpy as ref
from tests.test_policy import _full_qk, _load, _prompt, _waiting_rows_run

W = 8
BUFFER = 8


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    """Tiny Llama, 2 layers, 4 query heads over 2 KV heads (G = 2), head_dim 16."""
    return _load(tiny_checkpoint("llama")[0])


def _greedy(m: int) -> rkvjax.SamplingParams:
    return rkvjax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


def _ref_keep(stats, layer, k, held, *, t, prompt, budget) -> np.ndarray:
    """The reference's keep set of one (layer, row) -> [K, budget] positions.

    Args:
      stats: the model's `triattention_stats.Stats`.
      k: [T, K, H] the row's post-RoPE keys, indexed by position.
      held: [K][n] the positions each KV head holds, in slot order (the last W: the window).
      t, prompt: the row's next position and prompt length.
    """
    kh = k.shape[1]
    g = stats.q_heads // kh
    out = []
    for h in range(kh):
        pos = np.asarray(held[h])
        heads = slice(h * g, (h + 1) * g)
        idx = ref.keep(
            k[pos, h][None, None],
            pos[None, None],
            t=[t],
            prompt=[prompt],
            q_mean=stats.q_mean[layer][heads],
            q_abs_mean=stats.q_abs_mean[layer][heads],
            omega=stats.inv_freq,
            budget=budget,
            window=W,
        )[0, 0]
        out.append(pos[idx])
    return np.stack(out)


def _in_order(held, *, budget) -> np.ndarray:
    """[K, budget] what equal scores would keep: the lowest positions, then the window."""
    return np.stack([sorted(h[: budget - W]) + list(h[-W:]) for h in map(list, held)])


# ---------------------------------------------------------------------------------------------
# 1. The statistics.


def test_calibration_statistics_are_the_pre_rope_query_means(llama, stats_of):
    """Every token of every prompt weighs the same; the queries are the model's post-RoPE ones
    rotated back by their positions (float64 here), paired as q[f] + i q[f + H/2]."""
    stats = triattention_stats.load(stats_of("llama"))
    prompts = [_prompt(n, seed=900 + n) for n in CALIBRATION_LENGTHS]
    qs, _ = _full_qk(llama, prompts, max(CALIBRATION_LENGTHS))
    cfg = llama.config
    f = cfg.head_dim // 2
    omega = layers.rope_inv_freq(cfg)
    np.testing.assert_array_equal(stats.inv_freq, omega)
    for layer in range(cfg.num_layers):
        pairs = []
        for r, n in enumerate(CALIBRATION_LENGTHS):
            q = qs[layer][r][:n]  # [n, N, H]
            ang = (np.arange(n, dtype=np.float32)[:, None] * omega).astype(np.float64)
            c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]  # [n, 1, F]
            x1, x2 = q[..., :f], q[..., f:]
            pairs.append((x1 * c + x2 * s) + 1j * (x2 * c - x1 * s))  # [n, N, F]
        z = np.concatenate(pairs)  # [tokens, N, F]
        np.testing.assert_allclose(stats.q_mean[layer], z.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.q_abs_mean[layer], np.abs(z).mean(0), rtol=1e-5)
    assert stats.meta["tokens"] == sum(CALIBRATION_LENGTHS)
    assert stats.meta["prompts"] == len(CALIBRATION_LENGTHS)
    assert (stats.num_layers, stats.q_heads, stats.kv_heads, stats.head_dim) == (2, 4, 2, 16)


# ---------------------------------------------------------------------------------------------
# 2. One compression step against the reference.


def _made_up_stats(path, *, layers_, n_q, k_heads, h, seed) -> triattention_stats.Stats:
    """Statistics of no model (random, some frequencies nearly aligned), saved to `path`."""
    rng = np.random.default_rng(seed)
    f = h // 2
    shape = (layers_, n_q, f)
    mean = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    mean *= rng.uniform(0.1, 2.0, size=shape)
    meta = dict(
        format=triattention_stats.FORMAT,
        version=triattention_stats.VERSION,
        arch="none",
        num_layers=layers_,
        q_heads=n_q,
        kv_heads=k_heads,
        head_dim=h,
        tokens=1,
        prompts=1,
    )
    omega = (1.0 / 10000.0 ** (np.arange(0, h, 2) / h)).astype(np.float32)
    stats = triattention_stats.Stats(
        mean, np.abs(mean) + rng.uniform(0, 1, size=shape), omega, meta
    )
    triattention_stats.save(stats, path)
    return triattention_stats.load(path)


def _random_rows(rng, b, k_heads, n, h):
    """Keys [B, K, n, H], their positions [B, K, n] (ascending, holes of -1 among the
    candidates, the window the newest), next positions and prompt lengths [B]."""
    keys = rng.normal(size=(b, k_heads, n, h)).astype(np.float32)
    positions = np.zeros((b, k_heads, n), np.int32)
    t = rng.integers(n + 5, 400, size=b).astype(np.int32)
    prompt = np.zeros(b, np.int32)
    for r in range(b):
        prompt[r] = [0, rng.integers(1, t[r] // 2), t[r] - W][r % 3]  # none, some, every one
        for kv in range(k_heads):
            older = np.sort(rng.choice(t[r] - W, n - W, replace=False))
            positions[r, kv] = np.concatenate([older, np.arange(t[r] - W, t[r])])
            positions[r, kv, rng.choice(n - W, 5, replace=False)] = -1
    return keys, positions, t, prompt


@pytest.mark.parametrize("n_q,k_heads", [(6, 3), (4, 4), (9, 3)])
def test_one_step_matches_reference(tmp_path, n_q, k_heads):
    """Random keys at random positions (with holes), rows with no prompt, some and nothing but
    prompt among the candidates, several budgets, both normalisations and two offset ranges:
    the kept slots are the reference's, and the generated candidates' scores are too."""
    h, n, b = 16, 48, 3
    path = str(tmp_path / "stats.npz")
    stats = _made_up_stats(path, layers_=2, n_q=n_q, k_heads=k_heads, h=h, seed=n_q + k_heads)
    rng = np.random.default_rng(n_q * 10 + k_heads)
    q = jnp.asarray(rng.normal(size=(b, n_q, W, h)), jnp.float32)  # not read
    for options in [{}, {"normalize": False}, {"max_offset": 64}]:
        keys, positions, t, prompt = _random_rows(rng, b, k_heads, n, h)
        context = policies.Context(
            jnp.asarray(positions),
            jnp.asarray(t),
            jnp.asarray(prompt),
            jnp.zeros((b,), jnp.uint32),
            None,
            layer=1,
        )
        valid = jnp.asarray(positions >= 0)
        kw = dict(
            t=t,
            prompt=prompt,
            q_mean=stats.q_mean[1],
            q_abs_mean=stats.q_abs_mean[1],
            omega=stats.inv_freq,
            window=W,
            **options,
        )
        for budget in (12, 24, 40):
            got = C.select(
                "triattention",
                q,
                jnp.asarray(keys),
                valid,
                budget=budget,
                context=context,
                calibration=path,
                **options,
            )
            want = ref.keep(keys, positions, budget=budget, **kw)
            np.testing.assert_array_equal(got, want, err_msg=f"{options} budget {budget}")
        policy = policies.build("triattention", calibration=path, **options)
        score = np.asarray(C.candidate_scores(policy, q, jnp.asarray(keys), valid, context=context))
        g = n_q // k_heads
        for r in range(b):
            for kv in range(k_heads):
                pos = positions[r, kv, : n - W]
                there = np.flatnonzero(pos >= 0)
                heads = slice(kv * g, (kv + 1) * g)
                want = ref.kv_head_scores(
                    keys[r, kv, there],
                    pos[there],
                    t[r],
                    prompt[r],
                    stats.q_mean[1][heads],
                    stats.q_abs_mean[1][heads],
                    stats.inv_freq,
                    **options,
                )
                gen = ~np.isnan(want)
                got_s = score[r, kv, there]
                np.testing.assert_allclose(got_s[gen], want[gen], rtol=1e-5, atol=2e-5)
                assert (got_s[~gen] > 1e29).all()  # the prompt's, above every generated one


# ---------------------------------------------------------------------------------------------
# 3. In the engine: every compression against the reference.


@pytest.mark.parametrize("kind", ["llama", "qwen2_gqa3", "qwen3"])
@pytest.mark.parametrize("budget", [20, 28])
def test_prefill_and_first_decode_compressions_match_reference(
    tiny_checkpoint, stats_of, kind, budget
):
    """A prompt longer than the budget, compressed after prefill (all prompt: its first tokens
    and the window are kept), and a short one compressed while decoding at budget + buffer
    tokens (its prompt kept, the generated tokens by score), at every layer."""
    model = _load(tiny_checkpoint(kind)[0])
    path = stats_of(kind)
    stats = triattention_stats.load(path)
    prompts = [_prompt(9, seed=30 + budget), _prompt(40, seed=31 + budget)]
    outs = rkvjax.generate(
        model,
        prompts,
        method="triattention",
        calibration=path,
        budget=budget,
        buffer=BUFFER,
        max_new_tokens=budget + BUFFER - 9 + 2,
        record_kept=True,
    )
    _, ks = _full_qk(model, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)], 80)
    decisive = False
    for r, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.stats.compressions >= 1
        n = len(p) if len(p) > budget else budget + BUFFER  # held at the first compression
        held = [list(range(n))] * model.config.kv_heads
        for layer in range(model.config.num_layers):
            want = _ref_keep(stats, layer, ks[layer][r], held, t=n, prompt=len(p), budget=budget)
            np.testing.assert_array_equal(
                out.kept_positions[0, layer], want, err_msg=f"row {r} layer {layer}"
            )
            decisive |= not np.array_equal(want, _in_order(held, budget=budget))
    assert decisive  # the scores decide some of these sets, not only the prompt rule


def _simulate_layer0(stats, k0, p: int, events: int, *, budget, buffer):
    """The cache schedule of layer 0 replayed with the reference -> ([events, K, budget] kept
    positions, whether the scores decided any of them)."""
    kh = k0.shape[1]
    held = [list(range(p)) for _ in range(kh)]
    nxt, out, decisive = p, [], False
    if p > budget:
        out.append(_ref_keep(stats, 0, k0, held, t=p, prompt=p, budget=budget))
        held = [list(x) for x in out[-1]]
    while len(out) < events:
        grow = budget + buffer - len(held[0])
        held = [h + list(range(nxt, nxt + grow)) for h in held]
        nxt += grow
        out.append(_ref_keep(stats, 0, k0, held, t=nxt, prompt=p, budget=budget))
        decisive |= not np.array_equal(out[-1], _in_order(held, budget=budget))
        held = [list(x) for x in out[-1]]
    return np.stack(out), decisive


def test_decode_compressions_match_reference_with_waiting_rows(llama, stats_of):
    """Ragged rows (one compressed at prefill) and four rows of one length that fill on the same
    step with one lane, so three wait: every layer-0 compression replayed, and each row's tokens
    and keep sets as alone."""
    path = stats_of("llama")
    stats = triattention_stats.load(path)
    budget = 24
    lengths = (8, 9, 14, 30, 10, 10, 10, 10)
    prompts = [_prompt(n, seed=500 + i) for i, n in enumerate(lengths)]
    cc = compression_config("triattention", budget, buffer=BUFFER, calibration=path)
    got = _waiting_rows_run(llama, cc, prompts, [_greedy(56)] * len(prompts))
    _, ks = _full_qk(llama, [p + r.token_ids for p, r in zip(prompts, got, strict=True)], 96)
    for r, (p, res) in enumerate(zip(prompts, got, strict=True)):
        events = res.stats.compressions
        assert events >= 3
        want, decisive = _simulate_layer0(
            stats, ks[0][r], len(p), events, budget=budget, buffer=BUFFER
        )
        np.testing.assert_array_equal(res.kept_positions[:, 0], want, err_msg=f"row {r}")
        # The generated tokens kept are chosen by score (not for the 30-token prompt, which
        # fills every place the window leaves).
        assert decisive or len(p) >= budget - W
        assert (res.kept_positions[:, :, :, : min(len(p), budget - W)] < len(p)).all()


# ---------------------------------------------------------------------------------------------
# 4. Errors.


def test_errors_are_one_clear_line(tmp_path, llama, stats_of):
    with pytest.raises(ValueError, match="statistics of the model: run `rkvjax calibrate DATA"):
        policies.build("triattention")
    with pytest.raises(ValueError, match=r"needs calibration statistics"):
        compression_config("triattention", 16)
    missing = tmp_path / "missing.npz"
    with pytest.raises(ValueError, match=f"calibration statistics {missing}: no such file"):
        policies.build("triattention", calibration=str(missing))
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not statistics")
    with pytest.raises(ValueError, match=f"{garbage}: not a file of `rkvjax calibrate`"):
        policies.build("triattention", calibration=str(garbage))
    with pytest.raises(ValueError, match="max_offset must be a power of two"):
        policies.build("triattention", calibration=stats_of("llama"), max_offset=3)
    other = triattention_stats.load(stats_of("llama"))
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        triattention_stats.save(other, stats_of("llama"))
    # Statistics of another model: caught before anything compiles, naming the file.
    others = [
        ("qwen2_gqa3", "of 6 query heads over 2 KV heads of dimension 16, the model has 2 of 4"),
        ("qwen3", "of dimension 32, the model has"),
    ]
    for kind, what in others:
        path = stats_of(kind)
        with pytest.raises(ValueError, match=f"calibration statistics {path}: .*{what}"):
            rkvjax.generate(
                llama, [_prompt(30, 1)], method="triattention", calibration=path, budget=16
            )
    # A problem file is read as `rkvjax eval` reads it.
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "x"}\n')
    with pytest.raises(ValueError, match=f"{data}:2: needs `answer`"):
        calibration.read_prompts(data)
    (prompt,) = calibration.read_prompts(data, limit=1, chat=False)
    assert prompt == (f"{data}:1", f"1 + 1?\n{evaluation.R1_INSTRUCTION}", False)


# ---------------------------------------------------------------------------------------------
# 5. The command line.


@pytest.mark.parametrize(
    ("where", "message"),
    [("nofolder/out.npz", "folder .*nofolder does not exist"), ("afile.txt/out.npz", "is a file")],
)
def test_calibrate_checks_its_output_before_the_model_loads(
    tmp_path, monkeypatch, capsys, where, message
):
    """A calibration's output folder is checked first, not after the whole run."""
    (tmp_path / "afile.txt").write_text("x")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    monkeypatch.setattr(flags, "load", lambda args: pytest.fail("the model loaded"))
    assert cli.main(["calibrate", str(data), str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert re.match(f"rkvjax: error: .*{message}", err) and err.count("\n") == 1, err


def _engine_with(llama, path):
    cc = compression_config("triattention", 16, calibration=str(path))
    return rkvjax.Engine(llama, slots=1, cache=cc)


def test_statistics_of_another_model_or_impossible_ones_are_refused(tmp_path, llama, stats_of):
    """The same head layout is not enough: statistics of another RoPE (rope_theta), other
    weights or more layers than the model are refused by the engine before it compiles, and
    values no calibration gives (frequencies outside (0, 1], negative or too small mean
    moduli) when the file is read; each in one line naming the file."""
    mine = triattention_stats.load(stats_of("llama"))
    assert mine.meta["weight_norms"] == pytest.approx(triattention_stats.weight_norms(llama))
    assert mine.meta["model"]  # the folder it was calibrated on
    _engine_with(llama, stats_of("llama"))  # its own statistics pass

    def variant(name, **change):
        fields = dict(
            q_mean=mine.q_mean, q_abs_mean=mine.q_abs_mean, inv_freq=mine.inv_freq, meta=mine.meta
        )
        fields.update(change)
        path = tmp_path / f"{name}.npz"
        triattention_stats.save(triattention_stats.Stats(**fields), path)
        return path

    other_rope = dataclasses.replace(llama.config, rope_theta=2 * llama.config.rope_theta)
    theta = variant("theta", inv_freq=layers.rope_inv_freq(other_rope))
    with pytest.raises(ValueError, match=f"statistics {theta}: RoPE frequency 7 is .* rope_the"):
        _engine_with(llama, theta)
    norms = [2 * x for x in mine.meta["weight_norms"]]
    weights = variant("weights", meta={**mine.meta, "weight_norms": norms})
    with pytest.raises(ValueError, match=f"statistics {weights}: calibrated on other weights"):
        _engine_with(llama, weights)
    stack = {k: np.concatenate([v, v[:1]]) for k, v in (("q_mean", mine.q_mean),)}
    deeper = variant(
        "deeper",
        q_mean=stack["q_mean"],
        q_abs_mean=np.concatenate([mine.q_abs_mean, mine.q_abs_mean[:1]]),
        meta={**mine.meta, "num_layers": 3, "weight_norms": None},
    )
    with pytest.raises(ValueError, match=f"statistics {deeper}: hold 3 layers .* the model has 2"):
        _engine_with(llama, deeper)
    bad = [
        ("freq", dict(inv_freq=-mine.inv_freq), "`inv_freq` holds -1; RoPE's inverse freq"),
        ("negative", dict(q_abs_mean=-mine.q_abs_mean), "`q_abs_mean` holds negative values"),
        ("short", dict(q_abs_mean=mine.q_abs_mean / 4), "a mean query pair is longer than"),
    ]
    for name, change, what in bad:
        path = variant(name, **change)
        with pytest.raises(ValueError, match=f"calibration statistics {path}: {what}"):
            policies.build("triattention", calibration=str(path))


def test_calibrate_and_generate_on_the_command_line(tmp_path, llama, stats_of, capsys):
    """`rkvjax calibrate` writes what `calibrate` computes; --calibration takes it, and the job
    generates what `rkvjax.generate` does."""
    data, out = tmp_path / "data.jsonl", tmp_path / "stats.npz"
    prompts = [_prompt(n, seed=900 + n) for n in CALIBRATION_LENGTHS]
    data.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    model = ["--model", str(llama.path)]
    assert cli.main(["calibrate", str(data), str(out), *model, "--limit", "2"]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    got = triattention_stats.load(out)
    assert got.meta["prompts"] == 2 and got.meta["tokens"] == sum(CALIBRATION_LENGTHS[:2])
    assert cli.main(["calibrate", str(data), str(out), *model]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert cli.main(["calibrate", str(data), str(out), *model, "--overwrite"]) == 0
    want = triattention_stats.load(stats_of("llama"))
    got = triattention_stats.load(out)
    np.testing.assert_allclose(got.q_mean, want.q_mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.q_abs_mean, want.q_abs_mean, rtol=1e-6)
    capsys.readouterr()

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": _prompt(12, 3)}) + "\n")
    flags = [*model, "--method", "triattention", "--budget", "24", "--buffer", "8"]
    flags += ["--max-tokens", "30", "--ignore-eos", "--token-ids", "--calibration", str(out)]
    assert cli.main(["batch", str(src), str(dst), *flags]) == 0
    header, line = map(json.loads, dst.read_text().splitlines()[:2])
    assert header["settings"]["calibration"] == str(out)
    alone = rkvjax.generate(
        llama,
        _prompt(12, 3),
        method="triattention",
        calibration=str(out),
        budget=24,
        buffer=8,
        max_new_tokens=30,
        ignore_eos=True,
    )
    assert alone.stats.compressions >= 1
    assert line["token_ids"] == alone.token_ids
    capsys.readouterr()
    assert cli.main(["batch", str(src), str(tmp_path / "b.jsonl"), *flags[:-2]]) == 2
    assert "needs calibration statistics" in capsys.readouterr().err
    rkv = [*model, "--budget", "24", "--calibration", str(out)]
    assert cli.main(["batch", str(src), str(tmp_path / "c.jsonl"), *rkv]) == 2
    assert "--calibration: method 'rkv' reads no calibration statistics" in capsys.readouterr().err
