"""The default model (SmolLM2-135M-Instruct) end to end: parity, answers, CLI, stop strings."""

import json

import numpy as np
import pytest
import torch

import rkvjax
from rkvjax.entrypoints import cli

pytestmark = pytest.mark.slow


def test_logits_match_transformers(smol, smol_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    ids = smol.tokenizer.encode("The quick brown fox jumps over the lazy dog. 12345 + 678 = ?")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    got = np.asarray(rkvjax.logits(smol, ids))
    # 30 float32 layers: summation order alone moves logits of magnitude ~20 by ~1e-4 (the
    # features-major projections put one of 1.1M logits at 1.1e-4).
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-5)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_capital_of_france_is_paris(smol):
    out = rkvjax.generate(smol, "What is the capital of France?", max_new_tokens=24)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in smol.eos_token_ids
    assert out.stats.generated_tokens == len(out.token_ids)


def test_stop_string_cuts_text(smol):
    full = rkvjax.generate(smol, "What is the capital of France?", max_new_tokens=24)
    out = rkvjax.generate(
        smol, "What is the capital of France?", max_new_tokens=24, stop=["France"]
    )
    assert out.text == full.text[: full.text.index("France")]
    assert out.finish_reason == "stop"


def test_cli_prints_completion_and_stats(smol_dir, capsys):
    argv = ["generate", "What is the capital of France?", "--model", str(smol_dir)]
    assert cli.main([*argv, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "tok/s" in err and "time to first token" in err
    # The same length again (its programs are compiled): --json, and a stop string
    # that ends the answer at "Paris" (the row's finish reason and counts follow).
    assert cli.main([*argv, "--max-new-tokens", "24", "--json", "--stop", "Paris"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["finish_reason"] == "stop" and "Paris" not in row["text"]
    assert row["stats"]["generated_tokens"] == len(row["token_ids"]) < 24


def test_cli_reports_bad_arguments(smol_dir, capsys):
    argv = ["generate", "hi", "--model", str(smol_dir), "--max-new-tokens", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == "rkvjax: error: sampling flags: max_tokens must be an int >= 1, got 0\n"
