"""Batch invariance of the float caches (float32, bfloat16) for every built-in method: the other
half of `test_batch_invariance`'s matrix, in a file of its own so that a second worker runs it."""

import pytest

from rkvjax.kv import policies
from tests.test_batch_invariance import check_method
from tests.test_policy import _load

KV_DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return _load(tiny_checkpoint("llama_1layer")[0])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("method", policies.BUILTINS)
def test_sampled_rows_waiting_for_a_lane_equal_each_request_alone(
    llama, stats_of, method, kv_dtype
):
    check_method(llama, stats_of, method, kv_dtype)
