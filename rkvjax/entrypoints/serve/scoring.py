"""An echoed prompt's log-probabilities, under the served cache policy.

`/v1/completions` with `echo` and `logprobs` returns a log-probability for every prompt token
(the first is null). rkvjax computes them the way `rkvjax.score` scores a continuation: the
prompt's first token is prefilled and every later one is fed through the compiled decode step,
the served policy compressing the cache as it would while generating. So a prompt token's
log-probability is what the model gives it with the tokens before it held as the served cache
would hold them after decoding them: a prefix no longer than the budget is never compressed,
and under FullKV every log-probability equals the log-softmax of a full forward
(`rkvjax.logits`). A generated continuation is what it is without `echo`: its prompt is
prefilled and compressed at once when longer than the budget.
"""

from __future__ import annotations

from rkvjax import runtime
from rkvjax.sampling.params import SamplingParams

DEFAULT_SCORE_SLOTS = 8


def scoring_engine(
    engine: runtime.Engine, max_model_len: int, slots: int | None = None
) -> runtime.Engine:
    """A scoring engine (`Engine(teacher=True)`) beside the served `engine`: the same model,
    cache policy, logprobs limit and batch invariance, for prompts of up to `max_model_len`
    tokens. It allocates nothing until its first request."""
    cc = engine.compression
    rows = slots or min(engine.slots, DEFAULT_SCORE_SLOTS)
    return runtime.Engine(
        engine.model,
        slots=rows,
        cache=cc,
        max_len=None if cc.compressing else max(1, max_model_len - 1),
        logprobs=engine.limits.logprobs,
        stop_width=1,
        batch_invariant=engine.batch_invariant,
        teacher=True,
        given_len=max(1, max_model_len - 1),
    )


def prompt_request(engine: runtime.Engine, ids: list[int], logprobs: int, request_id: str):
    """The request scoring `ids[1:]` after `ids[0]` on a scoring engine, with the `logprobs`
    most likely tokens at each position."""
    sampling = SamplingParams(
        temperature=0.0, max_tokens=len(ids) - 1, ignore_eos=True, seed=0, logprobs=logprobs
    )
    return engine.prepare(
        ids[:1], sampling, request_id=request_id, continuation=ids[1:], where="request"
    )
