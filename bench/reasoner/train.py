"""Trains the reasoner: a small Llama-architecture model that runs the task of
`bench/reasoner/task.py` and writes its chain of thought, with JAX, Flax NNX and optax, from a
seed, into a Hugging Face folder (config.json, model.safetensors, tokenizer files) that
`rkvjax.load` reads.

    python -m bench.reasoner.train bench/reasoner/model            # the reasoner's folder
    python -m bench.reasoner.train /tmp/r --steps 20                # a smoke run

The model is rkvjax's own decoder (`rkvjax.models.decoder.Decoder`), so what is trained is
exactly what the engine runs. Each row of a batch packs whole problems (prompt, trace, end of
sequence) end to end; attention stays inside a problem and positions restart at each, so one
compiled step serves every length. The loss counts the trace and its end, not the prompt (whose
digits are random). Problems are drawn afresh for every batch from the seed (a curriculum can
grow their size; the default draws the full range from the start). Embeddings are factored
while training (`token_parts`: an evaluation token's row adds rows for its operands, sign and
value, shared with every token that has them), and written as one plain table. The same seed
gives the same weights on the same machine.

What makes a model this size learn the task (bench/README.md, "reasoner"): Llama's attention
biases, learning `bias_lr` times faster than the rest, and read supervision on two heads of one
layer. Both are training-time choices: the folder is a plain Llama checkpoint. The defaults
write the committed `bench/reasoner/model` in about 68 minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bench.reasoner import task, tokens

# The shape: a few million parameters; grouped-query attention so per-head kept sets differ.
SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    # About 2 s a step on two CPU cores at the default shape (B x T = 4K tokens): 2000 steps
    # take 70 minutes of the two hours the task allows.
    steps: int = 2000
    rows: int = 8  # B
    length: int = 512  # T: tokens per packed row
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.05
    clip: float = 1.0
    # The curriculum: the largest ops and rounds a problem may have grow linearly from the
    # first to the last pair over the first `grow` share of the steps. Starting small measured
    # worse (a plateau at 4.4 nats to step 200 where the full range was at 2.6), so the default
    # draws from the acceptance range and below from the start.
    start: tuple[int, int] = (5, 20)
    end: tuple[int, int] = (5, 20)
    grow: float = 0.6
    # Read supervision, training only (the checkpoint stays a plain Llama): query heads 0 and
    # 1 of layer `read_layer` are taught where each op's operands sit (the token holding each
    # variable's latest value, known from the generator), with this weight on their
    # cross-entropy beside the language model's. With `attention_bias` it is what lets the
    # model read a variable's newest value (bench/README "reasoner"); 0: off.
    read_weight: float = 0.3
    read_layer: int = 2
    # Llama's `attention_bias`: q/k/v/o biases. A query bias and a key bias make a positional
    # kernel of their own (b_q . R(t - s) b_k, whatever the tokens), which is how the read heads
    # come to prefer a variable's newest write over its older ones and its `vars` entry. The
    # kernel needs amplitudes of tens while Adam moves a parameter by about the learning rate a
    # step, so the q/k/v biases learn `bias_lr` times faster (and without weight decay).
    attention_bias: bool = True
    bias_lr: float = 10.0
    # The share of operands drawn from the loop's own targets instead of all eight variables
    # (training problems only; evaluation keeps the task's uniform draw). Uniform operands
    # mostly read a vars entry (two thirds of the reads of 3-5 op problems), and the read that
    # fails, a variable written once or a few times before, is rare in the data.
    reread: float = 0.0
    # Factored embeddings (a training parametrization; the checkpoint is a plain table): each
    # token's row is its own plus the sum of its parts' rows (`token_parts`: an evaluation
    # `=0+2=2\n` is "first operand 0" + "sign +" + "second operand 2" + "value 2", ...), so
    # what one token teaches reaches every token that shares a part. The parts' rows start at
    # this share of the table's scale, the tokens' own at 1 - it. 0: off.
    factored: float = 0.5
    # A number line in the round numbers' embeddings (`clock` x r / 40 times one learned
    # direction, a part of every round number), so that averaging over the round lines
    # written so far can tell how late a token is. Needs `factored`.
    clock: float = 1.0
    shape: tuple[tuple[str, int], ...] = tuple(SHAPE.items())
    # A reasoner folder to start from instead of the seed's initialisation (a second stage:
    # the same shape, trained further on another curriculum). Its embedding table is each
    # token's own row; factored parts start at zero.
    init: str | None = None


def hf_config(cfg: TrainConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": -(-len(tokens.VOCAB) // 32) * 32,  # the tokenizer's, rounded up
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        **dict(cfg.shape),  # the sizes, and any default above it overrides (rope_theta, ...)
        "attention_bias": cfg.attention_bias,
        "bos_token_id": None,
        "eos_token_id": tokens.VOCAB.index(tokens.EOS),
        "pad_token_id": tokens.VOCAB.index(tokens.PAD),
        "torch_dtype": "float32",
    }


def limits(cfg: TrainConfig, step: int) -> tuple[int, int]:
    """The curriculum's (max ops, max rounds) at `step`."""
    f = min(1.0, step / max(1, cfg.grow * cfg.steps))
    return tuple(round(a + f * (b - a)) for a, b in zip(cfg.start, cfg.end, strict=True))


def training_problem(rng: random.Random, cfg: TrainConfig, ops: int, rounds: int) -> task.Problem:
    """A problem of 1..`ops` ops over 1..`rounds` rounds; with `cfg.reread`, each operand is
    one of the loop's targets with that probability."""
    p = task.sample(rng, ops=(1, ops), rounds=(1, rounds))
    if not cfg.reread:
        return p
    targets = sorted({t for t, *_ in p.ops})

    def operand(v: str) -> str:
        return rng.choice(targets) if rng.random() < cfg.reread else v

    return dataclasses.replace(p, ops=tuple((t, operand(x), s, operand(y)) for t, x, s, y in p.ops))


def example(problem: task.Problem, tok) -> tuple[list[int], int]:
    """(token ids of prompt, trace and end of sequence; the prompt's length)."""
    prompt = tok.encode(problem.prompt()).ids
    trace = tok.encode(problem.trace()).ids
    return prompt + trace + [tokens.VOCAB.index(tokens.EOS)], len(prompt)


def example_length(ops: int, rounds: int) -> int:
    """The tokens a problem of `ops` ops over `rounds` rounds takes with its trace and end
    (every problem of that size: each token is one unit of the format)."""
    names = len(task.VARIABLES)
    vars_, loop, rounds_line, ask = 1 + 2 * names, 1 + 2 * ops, 1, 2  # words, spaces, newline
    return vars_ + loop + rounds_line + ask + rounds * (2 + 2 * ops) + 2 + 1


def reads(seq: list[int], plen: int) -> list[tuple[int, int, int]]:
    """Where each read of the trace `seq` (token ids, prompt first) finds its value: (index of
    an op token, index of the token holding its first operand's latest value, same for the
    second), and for the `answer ` token the asked variable's twice. A value sits in a `vars`
    entry (`d=0`) or in the evaluation token that follows an op writing the variable."""
    vocab = tokens.VOCAB
    entries, ops = set(tokens.ENTRIES), set(tokens.OPS)
    latest, out, ask = {}, [], None
    for i, tid in enumerate(seq):
        text = vocab[tid]
        if i < plen:
            if text in entries:
                latest[text[0]] = i
            elif text in tokens.ASKS and vocab[seq[i - 1]] == "ask ":
                ask = text[0]
        elif text in ops:
            out.append((i, latest[text[2]], latest[text[4]]))
            latest[text[0]] = i + 1
        elif text == "answer ":
            out.append((i, latest[ask], latest[ask]))
    return out


def pack(rng: random.Random, tok, cfg: TrainConfig, step: int) -> dict[str, np.ndarray]:
    """One batch of rows packed with whole problems drawn on the curriculum at `step`."""
    max_ops, max_rounds = limits(cfg, step)
    rows = []
    for _ in range(cfg.rows):
        row, at = [], 0
        while True:
            p = training_problem(rng, cfg, max_ops, max_rounds)
            seq, plen = example(p, tok)
            if at + len(seq) > cfg.length + 1:
                if at == 0:  # longer than a row: draw again
                    continue
                break
            row.append((seq, plen))
            at += len(seq)
        rows.append(row)
    return laid_out(rows, cfg.length + 1, sources=cfg.read_weight > 0)


def laid_out(
    rows: list[list[tuple[list[int], int]]], t: int, *, sources: bool = False
) -> dict[str, np.ndarray]:
    """Rows of examples (token ids, prompt length) laid end to end in `t` tokens each, as a
    batch: inputs, targets, loss weights (the trace and its end), positions within each
    example, segment ids (1, 2, ... per example; 0: padding) and, with `sources`, where each
    read finds its value (`reads`: what the read supervision needs, and only it)."""
    ids = np.zeros((len(rows), t), np.int32)
    weight = np.zeros((len(rows), t), np.float32)  # on the token predicted at this index
    pos = np.zeros((len(rows), t), np.int32)
    seg = np.zeros((len(rows), t), np.int32)
    source = np.zeros((len(rows), t, 2), np.int32)  # [B, T, 2] where each read finds its value
    source_weight = np.zeros((len(rows), t), np.float32)
    for r, row in enumerate(rows):
        at = 0
        for n, (seq, plen) in enumerate(row, 1):
            ids[r, at : at + len(seq)] = seq
            weight[r, at + plen : at + len(seq)] = 1.0
            pos[r, at : at + len(seq)] = np.arange(len(seq))
            seg[r, at : at + len(seq)] = n
            for i, x, y in reads(seq, plen) if sources else ():
                source[r, at + i] = at + x, at + y
                source_weight[r, at + i] = 1.0
            at += len(seq)
    batch = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "weights": weight[:, 1:],
        "positions": pos[:, :-1],
        "segments": seg[:, :-1],
    }
    if sources:
        batch |= {"sources": source[:, :-1], "source_weights": source_weight[:, :-1]}
    return batch


def forward(model, batch, capture: int | None = None):
    """The packed rows' logits [B, T, V] (float32), causal attention within each problem; layer
    `capture`'s queries and keys ([B, T, N, H], [B, T, K, H]; None without `capture`); the
    mask [B, T, S]."""
    from rkvjax.models import layers

    seg = jnp.asarray(batch["segments"])  # [B, T]
    t = seg.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)

    def attend(i, q, k, v, state):
        return layers.attention(q, k, v, mask, kv_axis=1), (q, k) if i == capture else state

    inputs, positions = jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"])
    x, qk = model.hidden(inputs, positions, attend, None)
    return model.head(x), qk, mask


def logits(model, batch) -> jax.Array:
    """The packed rows' logits [B, T, V] (float32)."""
    return forward(model, batch)[0]


def read_loss(q: jax.Array, k: jax.Array, mask: jax.Array, batch) -> jax.Array:
    """Cross-entropy of query heads 0 and 1 (both on KV head 0) attending to where each read's
    first and second operand sits, over the reads."""
    h = q.shape[-1]
    scores = jnp.einsum("BTNH,BSH->BNTS", q[:, :, :2], k[:, :, 0]) / math.sqrt(h)
    scores = jnp.where(mask[:, None], scores, -1e30)  # [B, 2, T, S]
    logp = jax.nn.log_softmax(scores, axis=-1)
    src = jnp.asarray(batch["sources"]).transpose(0, 2, 1)[..., None]  # [B, 2, T, 1]
    picked = jnp.take_along_axis(logp, src, axis=-1)[..., 0]  # [B, 2, T]
    w = jnp.asarray(batch["source_weights"])[:, None]  # [B, 1, T]
    return -jnp.sum(picked * w) / jnp.maximum(2.0 * jnp.sum(w), 1.0)


@nnx.jit
def _argmax(model, batch):
    return jnp.argmax(logits(model, batch), -1)


def rows_of(problems: list[task.Problem], tok, multiple: int = 64) -> dict[str, np.ndarray]:
    """One problem per row, padded to a common length (a multiple of `multiple`)."""
    seqs = [example(p, tok) for p in problems]
    t = -(-max(len(s) for s, _ in seqs) // multiple) * multiple + 1
    return laid_out([[s] for s in seqs], t)


def _predictions(model, problems: list[task.Problem], tok, chunk: int = 16):
    """Per problem (in order): its trace and end tokens, and the argmax at each given the right
    tokens before it, int [n] each."""
    for i in range(0, len(problems), chunk):
        b = rows_of(problems[i : i + chunk], tok)
        best = np.asarray(_argmax(model, {k: jnp.asarray(v) for k, v in b.items()}))
        for want, got, w in zip(b["targets"], best, b["weights"] > 0, strict=True):
            yield want[w], got[w]


def _hits(model, problems: list[task.Problem], tok, chunk: int = 16):
    """Per problem (in order): whether each trace and end token is the argmax given the right
    tokens before it, bool [n]."""
    for want, got in _predictions(model, problems, tok, chunk):
        yield want == got


def teacher_forced(model, problems: list[task.Problem], tok, chunk: int = 16) -> dict:
    """Greedy accuracy without decoding: a problem is right when every token of its trace and
    end is the argmax given the right tokens before it, which is exactly when greedy decoding
    writes the trace. Also the share of trace tokens right."""
    hits = list(_hits(model, problems, tok, chunk))
    return {
        "exact": float(np.mean([h.all() for h in hits])),
        "token": float(np.concatenate(hits).mean()),
    }


def token_kinds(problem: task.Problem) -> list[str]:
    """What each trace token (and the end) of `problem` decides, in order: "round" (the round
    line's two tokens), "op" (an op, copied from the loop), "evaluation: vars line" /
    "evaluation: this round" / "evaluation: an earlier round" (an op's operand values and
    result, by the hardest of its two operands' reads: an earlier round's write (a latest write
    among many), this round's, or only the vars line's), "answer" and "end".
    Where a model fails tells what it has not learnt yet."""
    last = dict.fromkeys(task.VARIABLES)  # the round of each variable's latest write
    order = {"vars line": 0, "this round": 1, "an earlier round": 2}
    kinds = []
    for r in range(1, problem.rounds + 1):
        kinds += ["round"] * 2  # `round ` and the number with its newline
        for target, x, _, y in problem.ops:
            wheres = [
                "vars line" if w is None else "this round" if w == r else "an earlier round"
                for w in (last[x], last[y])
            ]
            kinds += ["op", "evaluation: " + max(wheres, key=order.get)]
            last[target] = r
    return [*kinds, "answer", "answer", "end"]


def accuracy_by_kind(model, problems: list[task.Problem], tok) -> dict[str, float]:
    """Teacher-forced accuracy per `token_kinds` kind over `problems`."""
    right: dict[str, list[bool]] = {}
    for p, hit in zip(problems, _hits(model, problems, tok), strict=True):
        kinds = token_kinds(p)
        if len(kinds) != len(hit):
            raise ValueError(f"{len(hit)} trace tokens, {len(kinds)} kinds: the tokenizer moved")
        for k, h in zip(kinds, hit, strict=True):
            right.setdefault(k, []).append(bool(h))
    return {k: float(np.mean(v)) for k, v in sorted(right.items())}


def read_accuracy(model, problems: list[task.Problem], tok) -> dict[str, float]:
    """Teacher-forced accuracy of each operand an evaluation reads (the evaluation token's value
    for it), by how many writes of the variable precede the read: none (the vars entry), one,
    2-4, 5 or more. A model that matches a read to every token naming the variable and not to
    the newest reads the vars entry where one write follows it."""
    buckets = ((0, "read: vars entry"), (1, "read: 1 write"), (4, "read: 2-4 writes"))
    right: dict[str, list[bool]] = {}
    for p, (want, got) in zip(problems, _predictions(model, problems, tok), strict=True):
        evaluations = [(w, g) for w, g in zip(want, got, strict=True)
                       if tokens.VOCAB[w] in tokens.EVALS]  # fmt: skip
        writes = dict.fromkeys(task.VARIABLES, 0)
        ops = [op for _ in range(p.rounds) for op in p.ops]
        for (target, x, _, y), (w, g) in zip(ops, evaluations, strict=True):
            w, g = tokens.VOCAB[w], tokens.VOCAB[g]
            for at, var in ((1, x), (3, y)):  # `=x+y=v\n`: the operands' characters
                n = writes[var]
                key = next((k for top, k in buckets if n <= top), "read: 5+ writes")
                right.setdefault(key, []).append(g in tokens.EVALS and g[at] == w[at])
            writes[target] += 1
    return {k: float(np.mean(v)) for k, v in sorted(right.items())}


def _loss(trainee: Trainee, batch, read_layer: int, read_weight: float):
    capture = read_layer if read_weight else None
    out, qk, mask = forward(trainee.model(), batch, capture=capture)
    ce = optax.softmax_cross_entropy_with_integer_labels(out, batch["targets"])
    w = batch["weights"]  # the trace's tokens and its end only
    lm = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    reads_ = read_loss(*qk, mask, batch) if read_weight else jnp.zeros(())
    return lm + read_weight * reads_, (lm, reads_)


@nnx.jit(static_argnames=("read_layer", "read_weight"))
def train_step(trainee: Trainee, optimizer, batch, read_layer: int = 2, read_weight: float = 0.0):
    """One optimizer step; returns (language-model loss, read loss: 0 without supervision)."""
    grad_fn = nnx.value_and_grad(_loss, has_aux=True)
    (_, parts), grads = grad_fn(trainee, batch, read_layer, read_weight)
    optimizer.update(trainee, grads)
    return parts


def _schedule(cfg: TrainConfig, scale: float = 1.0):
    """Linear warm-up over `cfg.warmup` steps (a tenth of a run too short for them), then a
    cosine decay to a twentieth of the peak."""
    peak, warmup = cfg.lr * scale, min(cfg.warmup, cfg.steps // 10)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, cfg.steps, end_value=peak / 20)


def param_groups(params) -> Any:
    """ "bias" for the attention's q/k/v biases (`TrainConfig.bias_lr`), "rest" for the others."""

    def group(path, _) -> str:
        return "bias" if "bqkv" in jax.tree_util.keystr(path) else "rest"

    return jax.tree_util.tree_map_with_path(group, params)


def optimizer_for(trainee: Trainee, cfg: TrainConfig) -> nnx.Optimizer:
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.multi_transform(
            {
                "rest": optax.adamw(_schedule(cfg), weight_decay=cfg.weight_decay),
                "bias": optax.adamw(_schedule(cfg, cfg.bias_lr), weight_decay=0.0),
            },
            param_groups,
        ),
    )
    return nnx.Optimizer(trainee, tx, wrt=nnx.Param)


def token_parts(clock: float = 0.0) -> tuple[tuple[str, ...], np.ndarray]:
    """The parts tokens are made of and how much of each a token holds [V, P]: an evaluation's
    operands, sign and value, an op's target, operands and sign, a vars entry's variable and
    value (the same parts as an op's target and an evaluation's value: both write a variable),
    a round line's number and the prompt's round count (the same number part), and
    with `clock`, the round lines' number line (r / 40 x `clock`). Other tokens have none."""
    names: dict[str, int] = {}
    made_of: list[dict[int, float]] = []

    def ids(*parts: str) -> dict[int, float]:
        return {names.setdefault(p, len(names)): 1.0 for p in parts}

    for t in tokens.VOCAB:
        if t in tokens.EVALS:  # =a+b=v\n
            made_of.append(ids(f"x {t[1]}", f"sign {t[2]}", f"y {t[3]}", f"value {t[5]}"))
        elif t in tokens.OPS:  # t=x+y
            made_of.append(ids(f"var {t[0]}", f"op x {t[2]}", f"op sign {t[3]}", f"op y {t[4]}"))
        elif t in tokens.ENTRIES:  # v=d
            made_of.append(ids(f"var {t[0]}", f"value {t[2]}"))
        elif t in tokens.NUMBERS:  # a round line's: r\n
            made_of.append(ids("round line", f"number {t[:-1]}"))
            if clock:
                made_of[-1][names.setdefault("clock", len(names))] = clock * int(t) / 40
        elif t in tokens.COUNTS:  # rounds N\n: the same number, so a round can tell it is last
            made_of.append(ids("count", f"number {t[7:-1]}"))
        else:
            made_of.append({})
    matrix = np.zeros((len(tokens.VOCAB), len(names)), np.float32)
    for row, parts in enumerate(made_of):
        for col, w in parts.items():
            matrix[row, col] = w
    return tuple(names), matrix


class Fixed(nnx.Variable):
    """A constant that training carries and never optimizes."""


class Trainee(nnx.Module):
    """What training optimizes: the decoder and, with factored embeddings, the parts' rows that
    its embedding table's rows add (`model()` is the decoder with them added: what is scored
    and saved)."""

    def __init__(self, decoder, made_of: np.ndarray, share: float, key: jax.Array):
        self.decoder = decoder
        v, d = decoder.embed[...].shape
        pad = np.zeros((v, made_of.shape[1]), np.float32)  # the table's rows past the vocabulary
        pad[: len(made_of)] = made_of
        self.made_of = Fixed(jnp.asarray(pad))  # [V, P]
        scale = jnp.std(decoder.embed[...])
        if made_of.shape[1]:
            decoder.embed[...] = decoder.embed[...] * (1.0 - share)
        self.parts = nnx.Param(jax.random.normal(key, (pad.shape[1], d)) * scale * share)

    def model(self):
        """The decoder whose embedding table holds each token's own row plus its parts'."""
        if not self.parts.shape[0]:
            return self.decoder
        graphdef, state = nnx.split(self.decoder)
        state = jax.tree.map(lambda x: x, state)  # new variables: the trainee's stay its own
        state["embed"][...] = state["embed"][...] + self.made_of[...] @ self.parts[...]
        return nnx.merge(graphdef, state)


def init(cfg: TrainConfig) -> tuple[Trainee, Any]:
    from rkvjax.convert.hf_config import parse_hf_config
    from rkvjax.models.decoder import Decoder

    mcfg = parse_hf_config(hf_config(cfg), "the reasoner's config")
    if cfg.read_weight and not 0 <= cfg.read_layer < mcfg.num_layers:
        raise ValueError(f"read_layer {cfg.read_layer}: the model has {mcfg.num_layers} layers")
    if cfg.clock and not cfg.factored:
        raise ValueError("the clock is a part of the round numbers: it needs factored embeddings")
    made_of = token_parts(cfg.clock)[1] if cfg.factored else np.zeros((len(tokens.VOCAB), 0))
    if cfg.init is None:
        decoder = Decoder(mcfg, dtype=jnp.float32, rngs=nnx.Rngs(cfg.seed))
        return Trainee(decoder, made_of, cfg.factored, jax.random.key(cfg.seed + 1)), mcfg
    return Trainee(start_from(Path(cfg.init), cfg), made_of, 0.0, jax.random.key(0)), mcfg


def start_from(folder: Path, cfg: TrainConfig):
    """The decoder of the reasoner in `folder`, which must have the config `cfg` writes."""
    import rkvjax

    path = folder / "config.json"
    if not path.is_file():
        raise SystemExit(f"{folder}: no reasoner to start from (no config.json)")
    theirs, mine = json.loads(path.read_text()), hf_config(cfg)
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        what = ", ".join(f"{k}: {theirs.get(k)} here, {mine.get(k)} wanted" for k in differ)
        raise SystemExit(f"{path}: not this shape ({what})")
    return rkvjax.load(folder, dtype="float32").decoder


# Held-out problems scored during training (teacher-forced, so a score is one forward): the
# acceptance range, from a seed no training batch and no suite problem set uses.
HELD_OUT_SEED, HELD_OUT_PROBLEMS = 77_777, 64
# Where the curriculum reaches past the acceptance range's 20 rounds, also problems of its
# longest (3-5 ops): "held_out_long" in the log.
LONG_SEED, LONG_PROBLEMS = 77_778, 32


def evaluate(model, tok, problems: list[task.Problem]) -> dict:
    """Teacher-forced exact and token accuracy, accuracy per token kind and per read, rounded."""
    score = {
        **teacher_forced(model, problems, tok),
        **accuracy_by_kind(model, problems, tok),
        **read_accuracy(model, problems, tok),
    }
    return {k: round(v, 4) for k, v in score.items()}


def train(cfg: TrainConfig, out: Path, *, log=None, progress: bool = True, every: int = 0):
    """Trains from `cfg.seed` and writes the folder; returns (model, losses). With `every`,
    also scores held-out problems (`evaluate`, into the log) and writes the folder every
    `every` steps, so a long run that is stopped keeps its latest weights."""
    from tqdm import tqdm

    longest = example_length(*cfg.end)
    if longest > cfg.length + 1:
        raise ValueError(f"a problem of {cfg.end[0]} ops over {cfg.end[1]} rounds is {longest} "
                         f"tokens, more than a row of --length {cfg.length} + 1 holds")  # fmt: skip
    trainee, mcfg = init(cfg)
    optimizer = optimizer_for(trainee, cfg)
    tok = tokens.build()
    rng = random.Random(cfg.seed)
    held = task.problems(HELD_OUT_SEED, HELD_OUT_PROBLEMS) if every else []
    most = max(cfg.start[1], cfg.end[1])
    long = task.problems(LONG_SEED, LONG_PROBLEMS, rounds=(most, most)) if most > 20 else []
    long = long if every else []

    def report(step: int) -> None:
        model = trainee.model()
        score = {"step": step, "held_out": evaluate(model, tok, held)}
        if long:
            score["held_out_long"] = {"rounds": most, **{k: round(v, 4) for k, v in
                                      teacher_forced(model, long, tok).items()}}  # fmt: skip
        score["time"] = time.time()
        bar.write(json.dumps(score), file=sys.stderr)
        if log is not None:
            log.write(json.dumps(score) + "\n")
            log.flush()

    losses = []
    bar = tqdm(range(cfg.steps), desc="train", disable=not progress, file=sys.stderr)
    for step in bar:
        batch = pack(rng, tok, cfg, step)
        parts = train_step(trainee, optimizer, {k: jnp.asarray(v) for k, v in batch.items()},
                           read_layer=cfg.read_layer, read_weight=cfg.read_weight)  # fmt: skip
        loss, read = (float(x) for x in parts)
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss} at step {step}")
        losses.append(loss)
        if step % 10 == 0 or step == cfg.steps - 1:
            ops, rounds = limits(cfg, step)
            bar.set_postfix(loss=f"{loss:.4f}", read=f"{read:.3f}", ops=ops, rounds=rounds)
            if log is not None:
                row = {"step": step, "loss": loss, "read_loss": read, "max_ops": ops,
                       "max_rounds": rounds, "time": time.time()}  # fmt: skip
                log.write(json.dumps(row) + "\n")
                log.flush()
        if every and (step + 1) % every == 0 and step + 1 < cfg.steps:
            report(step)
            save(trainee.model(), mcfg, cfg, out)
    model = trainee.model()
    save(model, mcfg, cfg, out)
    if every:
        report(cfg.steps - 1)
    return model, losses


def save(model, mcfg, cfg: TrainConfig, out: Path) -> None:
    from rkvjax.convert.hf_safetensors import hf_tensors
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    gen = {"eos_token_id": hf_config(cfg)["eos_token_id"], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tensors = hf_tensors(model, mcfg)
    if mcfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens.save(out)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")


def plot_losses(losses: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no loss plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=0.5, alpha=0.4, label="step")
    k = max(1, len(losses) // 100)
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    ax.plot(np.arange(k - 1, len(losses)), smooth, label=f"mean of {k}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on the trace (nats/token)")
    ax.set_title("the reasoner's training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the model folder to write")
    d = TrainConfig()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--rows", type=int, default=d.rows)
    p.add_argument("--length", type=int, default=d.length)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--read-weight", type=float, default=d.read_weight,
                   help="weight of the read supervision (0: off)")  # fmt: skip
    p.add_argument("--read-layer", type=int, default=d.read_layer)
    p.add_argument("--bias-lr", type=float, default=d.bias_lr,
                   help="the q/k/v biases' learning rate over --lr")  # fmt: skip
    p.add_argument("--no-attention-bias", action="store_true",
                   help="a Llama without q/k/v/o biases (the reads are not learnt)")  # fmt: skip
    p.add_argument("--reread", type=float, default=d.reread,
                   help="share of training operands drawn from the loop's targets")  # fmt: skip
    p.add_argument("--factored", type=float, default=d.factored,
                   help="the parts' share of the embeddings at first (0: no parts)")  # fmt: skip
    p.add_argument("--clock", type=float, default=d.clock,
                   help="a number line in the round numbers' embeddings (0: none)")  # fmt: skip
    p.add_argument("--init", type=Path, default=None,
                   help="a reasoner folder to train further (the same shape) instead of the "
                   "seed's initialisation")  # fmt: skip
    p.add_argument(
        "--max-rounds",
        type=int,
        default=d.end[1],
        help="the longest training problems' rounds (ops up to 5 throughout)",
    )
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--every", type=int, default=250,
                   help="score held-out problems and write the folder every this many steps "
                   "(0: only at the end)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.init is not None and args.init.resolve() == args.out.resolve():
        p.error(f"--init {args.init} is the folder to write: write the new stage elsewhere")
    cfg = TrainConfig(seed=args.seed, steps=args.steps, rows=args.rows, length=args.length,
                      lr=args.lr, read_weight=args.read_weight, read_layer=args.read_layer,
                      reread=args.reread, factored=args.factored, clock=args.clock,
                      attention_bias=not args.no_attention_bias, bias_lr=args.bias_lr,
                      warmup=args.warmup, start=(d.start[0], args.max_rounds),
                      end=(d.end[0], args.max_rounds),
                      init=None if args.init is None else str(args.init))  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "train_log.jsonl", "w") as log:
        _, losses = train(cfg, args.out, log=log, progress=not args.no_progress,
                          every=args.every)  # fmt: skip
    plot_losses(losses, args.out / "loss.png")
    print(f"wrote {args.out} (final loss {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
