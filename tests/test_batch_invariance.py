"""A sample's numbers do not depend on the batch: every built-in method and cache type, sampled,
with rows waiting for a compression lane, against each request alone (`batch_invariant`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import layers

import rkvjax
from rkvjax.kv import policies, quantization
from rkvjax.kv.config import compression_config
from tests.test_policy import _load, _prompt

BUDGET, BUFFER, WINDOW = 10, 6, 4
# Three prompts of one length fill their caches on the same steps, so with two lanes one of
# them waits; the 13-token prompt is compressed at prefill, the others first while decoding.
# One length bucket: each engine compiles few programs (the test builds 64 engines).
LENGTHS = (9, 9, 9, 13, 5)
MAX_TOKENS = (30, 160, 150, 20, 22)  # two long ones: the tail narrows to two rows
SHORT_TOKENS = (30, 40, 35, 20, 22)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama_1layer")[0])


@pytest.mark.parametrize("columns", [1, 3, 8])
@pytest.mark.parametrize("shape", [(40, 32), (320, 64), (960, 576)])
def test_fixed_columns_give_each_column_the_same_bits_at_any_width(shape, columns):
    """Under `fixed_columns`, a column's product is the same to the bit whatever the number of
    columns beside it (fewer, as many, or several tiles of them) and wherever it sits, and it
    equals the plain product to float32 rounding."""
    rng = np.random.default_rng(0)
    out_dim, in_dim = shape
    w = jnp.asarray(rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim), jnp.float32)
    x = jnp.asarray(rng.standard_normal((in_dim, 3 * columns + 2, 1)), jnp.float32)

    @jax.jit
    def fixed(x):
        with layers.fixed_columns(columns):
            return layers.project("FD,DBT->FBT", w, x)

    alone = np.asarray(fixed(x[:, :1]))[:, 0]
    for width in range(1, x.shape[1] + 1):
        got = np.asarray(fixed(x[:, :width]))
        np.testing.assert_array_equal(got[:, 0], alone, err_msg=f"width {width}")
        last = np.asarray(fixed(x[:, width - 1 : width]))[:, 0]
        np.testing.assert_array_equal(got[:, width - 1], last, err_msg=f"width {width}")
    plain = np.asarray(jnp.einsum("FD,DBT->FBT", w, x, precision="highest"))
    np.testing.assert_allclose(np.asarray(fixed(x)), plain, rtol=1e-5, atol=1e-5)


def _sampled(i: int, m: int) -> rkvjax.SamplingParams:
    # Hot: the tiny model's logits are peaked, and a flatter distribution lets a difference in
    # the numbers change a sampled token.
    return rkvjax.SamplingParams(
        temperature=1.5, top_p=0.95, seed=100 + i, max_tokens=m, ignore_eos=True, logprobs=0
    )


def _batch_and_alone(model, cc, *, narrow: bool):
    """The LENGTHS requests, sampled, in four slots with two compression lanes (three rows fill
    at once, so one waits; a freed slot is refilled; with `narrow`, two long requests leave the
    tail to narrow to two rows), and each request alone in an engine of one slot and one lane:
    every product, prefill group and lane block at another width."""
    prompts = [_prompt(n, seed=700 + i) for i, n in enumerate(LENGTHS)]
    params = [_sampled(i, m) for i, m in enumerate(MAX_TOKENS if narrow else SHORT_TOKENS)]
    kw = dict(cache=cc, record_kept=True, logprobs=0, batch_invariant=True)
    batch = rkvjax.Engine(model, slots=4, lanes=2, narrow_tail=narrow, **kw)
    batch.submit_many(prompts, params)
    got = sorted(batch.run(), key=lambda r: r.request_id)
    assert batch.stats.stalled_row_steps > 0
    assert (batch.stats.narrowings > 0) is narrow
    assert all(r.stats.batch_invariant for r in got)
    one = rkvjax.Engine(model, slots=1, **kw)
    alone = []
    for p, sp in zip(prompts, params, strict=True):
        one.submit(p, sp)
        alone += one.run()
    return got, alone


def _assert_same(got, alone):
    for r, (res, ref) in enumerate(zip(got, alone, strict=True)):
        assert res.token_ids == ref.token_ids, f"request {r}"
        np.testing.assert_array_equal(res.logprobs, ref.logprobs, err_msg=f"request {r}")
        np.testing.assert_array_equal(res.kept_positions, ref.kept_positions)
        assert res.stats.compressions >= 2


def check_method(model, stats_of, method: str, kv_dtype: str) -> None:
    """A method and cache type, sampled, with a row waiting for a lane: each request's tokens,
    logprobs and kept sets are those of the request alone, to the bit."""
    opts = {"calibration": stats_of("llama_1layer")} if method == "triattention" else {}
    cc = compression_config(method, BUDGET, buffer=BUFFER, window=WINDOW, kv_dtype=kv_dtype, **opts)
    _assert_same(*_batch_and_alone(model, cc, narrow=False))


# The float caches' half of every method x cache type is in test_batch_invariance_float.py, so
# that the two halves run on two workers.
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("method", policies.BUILTINS)
def test_sampled_rows_waiting_for_a_lane_equal_each_request_alone(
    llama, stats_of, method, kv_dtype
):
    check_method(llama, stats_of, method, kv_dtype)


def test_the_matrix_covers_every_cache_type():
    from tests import test_batch_invariance_float as floats

    assert {"int8", "float8_e4m3fn", *floats.KV_DTYPES} == set(quantization.KV_DTYPES)


@pytest.mark.parametrize(("method", "kv_dtype"), [("rkv", "int8"), ("h2o", "float8_e4m3fn")])
def test_a_request_equals_itself_alone_when_the_tail_narrows(llama, method, kv_dtype):
    """The same when the batch narrows mid-request: the long requests' rows move to a
    two-row state, so their products change width halfway through."""
    cc = compression_config(method, BUDGET, buffer=BUFFER, window=WINDOW, kv_dtype=kv_dtype)
    _assert_same(*_batch_and_alone(llama, cc, narrow=True))


def test_batch_invariance_is_on_by_default_for_an_8bit_cache_only(llama):
    """The default follows the cache: on for int8 and fp8 (their rounding turns the last-bit
    differences of width-dependent products into other codes), off for float caches; asking
    for it where it cannot hold is one clear error."""
    for kv_dtype, want in (("int8", True), ("float8_e4m3fn", True), (None, False)):
        cc = compression_config("rkv", BUDGET, buffer=BUFFER, kv_dtype=kv_dtype)
        eng = rkvjax.Engine(llama, slots=2, cache=cc)
        assert eng.batch_invariant is want
        assert (eng.plan.invariant_columns > 0) is want
    cc = compression_config("rkv", BUDGET, buffer=BUFFER, kv_dtype="int8")
    assert not rkvjax.Engine(llama, slots=2, cache=cc, batch_invariant=False).batch_invariant
    assert not rkvjax.Engine(llama, slots=2, cache=cc, prefill_by_length=False).batch_invariant
    with pytest.raises(ValueError, match="prefill_by_length"):
        rkvjax.Engine(llama, slots=2, cache=cc, batch_invariant=True, prefill_by_length=False)
    with pytest.raises(ValueError, match="batch_invariant must be"):
        rkvjax.Engine(llama, slots=2, cache=cc, batch_invariant="yes")


def test_score_rows_equal_each_row_alone_with_an_8bit_cache(llama):
    """Teacher forcing through an int8 cache (batch-invariant by default): a batch scores each
    row as it scores alone, to the bit."""
    seqs = [_prompt(n, seed=800 + n) for n in (50, 41, 60)]
    kw = dict(prompt_len=12, method="rkv", budget=BUDGET, buffer=BUFFER, kv_dtype="int8")
    batch = rkvjax.score(llama, seqs, **kw)
    for seq, res in zip(seqs, batch, strict=True):
        alone = rkvjax.score(llama, seq, **kw)
        np.testing.assert_array_equal(res.logprobs, alone.logprobs)


def test_the_command_line_flag_reaches_the_engine_and_the_job_header():
    """--batch-invariant / --no-batch-invariant are the engine's keyword (job headers record
    it when given, so earlier jobs' headers still match); the cache policy never sees it."""
    from rkvjax.entrypoints import cli
    from rkvjax.entrypoints.cli import flags

    parse = cli.parser().parse_args
    for flag, want in (("--batch-invariant", True), ("--no-batch-invariant", False)):
        cache = flags.cache(parse(["batch", "in.jsonl", "out.jsonl", "--budget", "16", flag]))
        assert cache["batch_invariant"] is want
        assert "batch_invariant" not in flags.policy(cache)
        compression_config(**flags.policy(cache))
    assert "batch_invariant" not in flags.cache(parse(["generate", "x", "--budget", "16"]))
