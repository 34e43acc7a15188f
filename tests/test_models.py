"""Model parity with Hugging Face transformers on tiny random checkpoints of each architecture."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rkvjax
from tests.hf_tiny import KINDS, VOCAB
from tests.tolerances import LOGITS_ATOL


def _ids(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_match_transformers(tiny_checkpoint, kind):
    folder, hf = tiny_checkpoint(kind)
    model = rkvjax.load(folder, dtype="float32")
    # 150 positions: past the llama3 scaling's original context (64), so every RoPE band is used.
    ids = _ids(2, 150)
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(rkvjax.logits(model, ids))
    assert got.shape == (2, 150, VOCAB)
    np.testing.assert_allclose(got, want, atol=LOGITS_ATOL[jnp.float32], rtol=0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_transformers_64_tokens(tiny_checkpoint, kind):
    folder, hf = tiny_checkpoint(kind)
    model = rkvjax.load(folder, dtype="float32")
    prompt = _ids(1, 11, seed=1)
    with torch.no_grad():
        want = hf.generate(
            torch.tensor(prompt),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, prompt.shape[1] :].tolist()
    out = rkvjax.generate(model, prompt[0].tolist(), max_new_tokens=64, ignore_eos=True)
    assert len(want) == 64
    assert out.token_ids == want
    assert out.finish_reason == "length"
    assert out.stats.generated_tokens == 64


def test_bfloat16_close_to_float32(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen3")
    ids = _ids(1, 40)
    f32 = np.asarray(rkvjax.logits(rkvjax.load(folder, dtype="float32"), ids))
    bf16_model = rkvjax.load(folder, dtype="bfloat16")
    assert bf16_model.decoder.layers[0].attn.wqkv[...].dtype == jnp.bfloat16
    bf16 = np.asarray(rkvjax.logits(bf16_model, ids))
    np.testing.assert_allclose(bf16, f32, atol=LOGITS_ATOL[jnp.bfloat16], rtol=0)
