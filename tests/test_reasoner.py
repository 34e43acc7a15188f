"""The reasoner: its task (generator, trace, grader), tokenizer, the exporter its checkpoint is
written with, and the training program (reproducible from a seed, loadable by the engine)."""

import json
import random

import jax
import numpy as np
import pytest
from flax import nnx

import rkvjax
from bench.reasoner import task, tokens, train

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def test_the_issue_example_runs_to_its_answer():
    p = task.parse(
        "vars a=5 b=2 c=6 d=0 e=1 f=8 g=1 h=5\nloop a=d+b g=g+d b=g+b d=a-a d=a+e\nrounds 14\n"
        "ask c\n"
    )
    trace = p.trace()
    assert trace.startswith("round 1\na=d+b=0+2=2\ng=g+d=1+0=1\n")
    # The issue elides rounds 2-13 and its last op line is illustrative: run in order on the
    # current values (as the issue specifies), round 14 ends a=3 g=9 b=8 d=0 then d=3+1=4.
    assert trace.split("\n")[-7:-1] == [
        "round 14", "a=d+b=4+9=3", "g=g+d=5+4=9", "b=g+b=9+9=8", "d=a-a=3-3=0", "d=a+e=3+1=4"
    ]  # fmt: skip
    assert trace.endswith("answer 6")
    assert p.answer() == 6 and task.grade(p, trace) == task.Grade(True, 6, 6, None, 14, None)


def _reference_answer(p: task.Problem) -> int:
    env = dict(zip("abcdefgh", p.values, strict=True))
    for _ in range(p.rounds):
        for t, x, s, y in p.ops:
            env[t] = (env[x] + (env[y] if s == "+" else -env[y])) % 10
    return env[p.ask]


def test_problems_are_seeded_in_range_and_parse_back():
    ps = task.problems(7, 200)
    assert ps == task.problems(7, 200) and ps != task.problems(8, 200)
    for p in ps:
        assert 3 <= len(p.ops) <= 5 and 8 <= p.rounds <= 20
        assert task.parse(p.prompt()) == p
        assert p.answer() == _reference_answer(p)
    with pytest.raises(ValueError, match="line 3"):
        task.parse(ps[0].prompt().replace(f"rounds {ps[0].rounds}", "rounds 41"))
    with pytest.raises(ValueError, match="ops"):
        task.sample(random.Random(0), ops=(0, 3))


def test_the_grader_names_what_went_wrong():
    p = task.problems(0, 1)[0]
    good = p.trace()
    lines = good.split("\n")
    lines[2] = lines[2][:-1] + str((int(lines[2][-1]) + 1) % 10)  # a result written wrong
    got = task.grade(p, "\n".join(lines))
    assert got.failure == "value" and got.first_wrong_line == 3
    assert task.grade(p, good.replace("answer", "the answer is")).failure == "no answer"
    # A stray letter inside an op line is not the format (`a=d+b=0a+2=2`: the target repeated).
    op = good.split("\n")[1]
    stray = good.replace(op, op[:7] + op[0] + op[7:], 1)
    assert task.grade(p, stray).failure == "format" and task.grade(p, stray).first_wrong_line == 2
    short = good.rsplit(f"round {p.rounds}\n", 1)[0] + f"answer {p.answer()}"
    assert task.grade(p, short).failure == "rounds"
    wrong = good[:-1] + str((p.answer() + 1) % 10)
    assert task.grade(p, wrong) == task.Grade(False, (p.answer() + 1) % 10, p.answer(),
                                              "answer", p.rounds, None)  # fmt: skip


def test_the_tokenizer_encodes_every_text_and_the_engine_reads_it(tmp_path):
    tok = tokens.build()
    for p in task.problems(1, 50, ops=(1, 8), rounds=(1, 40)):
        text = p.prompt() + p.trace()
        enc = tok.encode(text)
        assert tokens.UNK not in enc.tokens and tok.decode(enc.ids) == text
    assert tok.encode("rounds 12\nround 3\n").tokens == ["rounds 12\n", "round ", "3\n"]
    assert tok.encode("rounds 41\n").tokens == ["rounds ", "4", "1\n"]  # out of range: encodes
    # Every round line is two tokens: a problem's rounds all span the same positions.
    assert {len(tok.encode(f"round {r}\n").ids) for r in range(1, 41)} == {2}
    # An op line is the op (the loop's own token) and its evaluation; a vars entry is one.
    assert tok.encode("a=d+b=0+2=2\n").tokens == ["a=d+b", "=0+2=2\n"]
    assert tok.encode("loop a=d+b h=h-h\n").tokens == ["loop ", "a=d+b", " ", "h=h-h", "\n"]
    assert tok.encode("vars a=5 b=2").tokens == ["vars ", "a=5", " ", "b=2"]
    assert tok.encode("ask c\nanswer 6").tokens == ["ask ", "c\n", "answer ", "6"]
    # A wrong evaluation still encodes (the grader, not the tokenizer, judges it).
    assert tok.encode("a=d+b=0+2=7\n").tokens == ["a=d+b", "=0+2=7\n"]
    tokens.save(tmp_path)
    from rkvjax.text.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(tmp_path)
    text = task.problems(2, 1)[0].prompt()
    assert ours.encode(text) == tok.encode(text).ids
    assert ours.eos_token_ids == (tokens.VOCAB.index(tokens.EOS),)


def test_hf_tensors_inverts_loading(tiny_checkpoint):
    """A loaded checkpoint's weights, exported, are the checkpoint's tensors exactly."""
    from rkvjax.convert.hf_safetensors import hf_tensors
    from safetensors.numpy import load_file

    for kind in ("llama", "llama_mha_tied_bias", "qwen2", "qwen3"):
        folder, _ = tiny_checkpoint(kind)
        model = rkvjax.load(folder, dtype="float32")
        want = load_file(folder / "model.safetensors")
        got = hf_tensors(model.decoder, model.config)
        if model.config.tie_embeddings:
            want.pop("lm_head.weight", None)
        assert got.keys() == want.keys(), kind
        for name in want:
            np.testing.assert_array_equal(got[name], want[name].astype(np.float32), err_msg=name)


def test_training_is_reproducible_and_the_engine_runs_its_folder(tmp_path):
    """The same seed gives the same weights; the folder loads and generates through rkvjax."""
    cfg = train.TrainConfig(steps=3, rows=2, length=192, warmup=1, start=(2, 4), end=(2, 4),
                            read_layer=1, shape=tuple(SMALL.items()))  # fmt: skip
    with open(tmp_path / "log.jsonl", "w") as log:
        a, losses = train.train(cfg, tmp_path / "a", progress=False, log=log, every=2)
    train.train(cfg, tmp_path / "b", progress=False)
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    other = train.TrainConfig(**{**cfg.__dict__, "seed": 1})
    train.train(other, tmp_path / "c", progress=False)
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["seed"] == 0
    # Held-out scores in the log: one after step 2 of 3 (the folder written then too), one at
    # the end.
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "held_out" in r]
    assert [r["step"] for r in scored] == [1, 2]
    assert {"exact", "token", "round", "op"} <= scored[-1]["held_out"].keys()
    model = rkvjax.load(tmp_path / "a", dtype="float32")
    problem = task.problems(0, 1)[0]
    prompt = problem.prompt()
    out = rkvjax.generate(model, prompt, max_new_tokens=8, chat=False)
    assert len(out.token_ids) <= 8
    # The teacher-forced argmax after the prompt is the engine's first greedy token.
    tok = tokens.build()
    rows = train.rows_of([problem], tok)
    first = np.asarray(train._argmax(a, rows))[0, len(tok.encode(prompt).ids) - 1]
    assert first == out.token_ids[0]
    score = train.teacher_forced(a, [problem] * 3, tok)
    assert score["exact"] in (0.0, 1.0) and 0 <= score["token"] <= 1
    # Per kind: every trace token has one, and the shares weigh back to the token accuracy.
    kinds = train.token_kinds(problem)
    assert len(kinds) == len(tok.encode(problem.trace()).ids) + 1
    by_kind = train.accuracy_by_kind(a, [problem], tok)
    counts = {k: kinds.count(k) for k in by_kind}
    assert sum(by_kind[k] * counts[k] for k in by_kind) / len(kinds) == pytest.approx(
        train.teacher_forced(a, [problem], tok)["token"]
    )
    assert {"round", "op", "answer", "end"} <= by_kind.keys()
    assert any(k.startswith("evaluation: ") for k in by_kind)
    # What the engine computes is what training computed: the full forward's logits agree.
    ids = model.tokenizer.encode(prompt)
    batch = {"inputs": np.array([ids]), "positions": np.arange(len(ids))[None],
             "segments": np.ones((1, len(ids)), np.int32)}  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(rkvjax.logits(model, ids))[0], np.asarray(train.logits(a, batch))[0], atol=1e-4
    )


def test_the_suite_grades_settings_and_splits_by_length():
    from bench.reasoner import suite

    ps = task.problems(3, 40)
    lengths = [len(p.trace()) for p in ps]
    edges = suite.quartile_edges(lengths)
    perfect = suite.grade_all(ps, [p.trace() for p in ps], lengths, edges)
    assert perfect["accuracy"] == 100 and perfect["accuracy_by_length"] == [100.0] * 4
    silent = suite.grade_all(ps, [""] * len(ps), lengths, edges)
    assert silent["accuracy"] == 0 and silent["failures"]["no answer"] == len(ps)
    # Right only on the shortest quarter: the buckets say so.
    short = [p.trace() if n <= edges[0] else "" for p, n in zip(ps, lengths, strict=True)]
    split = suite.grade_all(ps, short, lengths, edges)
    assert split["accuracy_by_length"][0] == 100 and split["accuracy_by_length"][1:] == [0.0] * 3

    import argparse

    args = argparse.Namespace(methods=["full", "rkv", "snapkv"], budgets=[32, 64],
                              kv_dtypes=["model", "int8"], shares=["none", "heads"])  # fmt: skip
    got = suite.settings(args)
    assert len(got) == 2 * (1 + 2 * 2 * 2)  # FullKV once per storage type
    assert {"method": "full", "budget": None, "kv_dtype_arg": "int8", "share": "none"} in got


def test_token_kinds_say_where_each_operand_was_last_written():
    p = task.parse(
        "vars a=5 b=2 c=6 d=0 e=1 f=8 g=1 h=5\nloop a=d+b g=g+d d=a-e\nrounds 2\nask c\n"
    )
    kinds = train.token_kinds(p)
    assert len(kinds) == 2 * (2 + 3 * 2) + 3
    # Each evaluation is classed by its hardest read: an earlier round, this round, vars only.
    evaluations = [k.removeprefix("evaluation: ") for k in kinds if k.startswith("evaluation")]
    assert evaluations == [
        "vars line", "vars line", "this round",  # round 1: d, b; g, d; a (this round), e
        "an earlier round", "an earlier round", "this round",  # round 2
    ]  # fmt: skip
    assert kinds[:4] == ["round", "round", "op", "evaluation: vars line"]
    assert kinds[-3:] == ["answer", "answer", "end"]


def test_example_length_is_exact_and_a_row_must_hold_the_longest():
    tok = tokens.build()
    for i in range(200):
        p = task.sample(random.Random(i), ops=(1, 8), rounds=(1, 40))
        assert len(train.example(p, tok)[0]) == train.example_length(len(p.ops), p.rounds)
    assert train.example_length(8, 40) == 760
    cfg = train.TrainConfig(steps=1, length=512, start=(5, 20), end=(8, 40))
    with pytest.raises(ValueError, match="8 ops over 40 rounds is 760 tokens"):
        train.train(cfg, None, progress=False)


def test_reads_point_at_the_tokens_holding_each_operand():
    """The read supervision's sources: the token holding each operand's latest value (a `vars`
    entry or an earlier evaluation), checked against the values the trace writes."""
    tok, vocab = tokens.build(), tokens.VOCAB
    checked = 0
    for i in range(60):
        p = task.sample(random.Random(i), ops=(1, 8), rounds=(1, 12))
        seq, plen = train.example(p, tok)

        def value(j, seq=seq):
            text = vocab[seq[j]]  # `d=0` or `=0+2=2\n`
            return int(text[2]) if text in tokens.ENTRIES else int(text[-2])

        found = train.reads(seq, plen)
        assert len(found) == len(p.ops) * p.rounds + 1
        for j, x, y in found:
            assert x < j and y < j
            if vocab[seq[j]] == "answer ":
                assert value(x) == value(y) == p.answer()
                continue
            evaluation = vocab[seq[j + 1]]
            assert (value(x), value(y)) == (int(evaluation[1]), int(evaluation[3]))
            checked += 1
    assert checked > 1000
    examples = [[train.example(p, tok)] for p in task.problems(5, 2)]
    assert "sources" not in train.laid_out(examples, 400)  # only for the read supervision
    batch = train.laid_out(examples, 400, sources=True)
    assert batch["sources"].shape == (2, 399, 2) and batch["source_weights"].sum() > 0
    assert (batch["sources"][batch["source_weights"] == 0] == 0).all()


def test_read_supervision_and_the_clock_train_and_check_their_layer(tmp_path):
    small = SMALL
    cfg = train.TrainConfig(steps=2, rows=2, length=192, warmup=1, start=(2, 4), end=(2, 4),
                            read_weight=0.3, read_layer=1, clock=0.3,
                            shape=tuple(small.items()))  # fmt: skip
    names, made_of = train.token_parts(clock=0.3)
    numbers = [tokens.VOCAB.index(t) for t in tokens.NUMBERS]
    clock = made_of[:, names.index("clock")]
    assert np.flatnonzero(clock).tolist() == numbers  # the clock is a part of round numbers only
    assert clock[numbers] == pytest.approx(0.3 * np.arange(1, 41) / 40)
    with open(tmp_path / "log.jsonl", "w") as log:
        train.train(cfg, tmp_path / "m", progress=False, log=log)
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["read_loss"] > 0
    with pytest.raises(ValueError, match="read_layer 2"):
        train.init(train.TrainConfig(**{**cfg.__dict__, "read_layer": 2}))
    with pytest.raises(ValueError, match="factored"):
        train.init(train.TrainConfig(**{**cfg.__dict__, "factored": 0.0}))


def test_factored_embeddings_share_parts_and_save_as_a_plain_table():
    names, made_of = train.token_parts()
    assert "clock" not in names

    def parts(token):
        return {names[c] for c in np.flatnonzero(made_of[tokens.VOCAB.index(token)])}

    assert parts("=0+2=2\n") == {"x 0", "sign +", "y 2", "value 2"}
    assert parts("a=d-b") == {"var a", "op x d", "op sign -", "op y b"}
    assert parts("a=5") == {"var a", "value 5"}  # what an op's target and a result write
    assert parts("7\n") == {"round line", "number 7"}
    assert parts("rounds 7\n") == {"count", "number 7"}
    assert parts("round ") == set() and parts("c\n") == set()
    assert set(np.unique(made_of)) == {0.0, 1.0}
    cfg = train.TrainConfig(read_layer=1, shape=tuple(SMALL.items()))
    trainee, _ = train.init(cfg)
    made_of = train.token_parts(cfg.clock)[1]
    table = np.asarray(trainee.model().embed[...])
    own = np.asarray(trainee.decoder.embed[...])
    rows = np.asarray(trainee.parts[...])
    np.testing.assert_allclose(table[: len(made_of)], own[: len(made_of)] + made_of @ rows,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    np.testing.assert_array_equal(table[len(made_of) :], own[len(made_of) :])  # padding rows
    trainee.model()
    np.testing.assert_array_equal(np.asarray(trainee.decoder.embed[...]), own)  # rows its own
    plain, _ = train.init(
        train.TrainConfig(factored=0.0, clock=0.0, read_layer=1, shape=tuple(SMALL.items()))
    )
    assert plain.model() is plain.decoder and plain.parts.shape[0] == 0


def test_read_accuracy_counts_the_writes_before_each_read(monkeypatch):
    tok = tokens.build()
    problems = task.problems(5, 12)
    eos = tokens.VOCAB.index(tokens.EOS)

    def traces(model, ps, tok, stale=False):
        for p in ps:
            want = np.array([*tok.encode(p.trace()).ids, eos])
            got = want.copy()
            first = dict(zip(task.VARIABLES, p.values, strict=True))
            ops = iter([op for _ in range(p.rounds) for op in p.ops])
            for i, t in enumerate(want):
                if stale and tokens.VOCAB[t] in tokens.EVALS:  # reads the vars entries only
                    _, x, s, y = next(ops)
                    ev = tokens.VOCAB[t]
                    got[i] = tokens.VOCAB.index(f"={first[x]}{s}{first[y]}={ev[5]}\n")
            yield want, got

    monkeypatch.setattr(train, "_predictions", traces)
    perfect = train.read_accuracy(None, problems, tok)
    assert set(perfect) == {"read: vars entry", "read: 1 write", "read: 2-4 writes",
                            "read: 5+ writes"} and set(perfect.values()) == {1.0}  # fmt: skip
    monkeypatch.setattr(train, "_predictions", lambda *a: traces(*a, stale=True))
    stale = train.read_accuracy(None, problems, tok)
    assert stale["read: vars entry"] == 1.0
    assert all(stale[k] < 0.5 for k in stale if k != "read: vars entry")


def test_reread_draws_operands_from_the_loops_targets():
    cfg = train.TrainConfig()
    plain = [train.training_problem(random.Random(i), cfg, 5, 20) for i in range(50)]
    assert plain == [task.sample(random.Random(i), ops=(1, 5), rounds=(1, 20)) for i in range(50)]
    always = train.TrainConfig(reread=1.0)
    for i in range(50):
        p = train.training_problem(random.Random(i), always, 5, 20)
        targets = {t for t, *_ in p.ops}
        assert all(x in targets and y in targets for _, x, _, y in p.ops)
        assert p.trace().endswith(f"answer {p.answer()}")


def test_the_attention_biases_learn_at_their_own_rate():
    """The q/k/v biases (and only they) are the "bias" group, stepped at `bias_lr` x the rate:
    Adam's first step moves each parameter by its learning rate."""
    cfg = train.TrainConfig(steps=20, warmup=0, lr=1e-3, bias_lr=10.0, rows=2, length=192,
                            start=(2, 4), end=(2, 4), read_layer=1,
                            shape=tuple(SMALL.items()))  # fmt: skip
    trainee, mcfg = train.init(cfg)
    assert mcfg.qkv_bias and mcfg.o_bias and train.hf_config(cfg)["attention_bias"] is True
    groups = jax.tree_util.tree_leaves_with_path(train.param_groups(nnx.state(trainee, nnx.Param)))
    biased = [jax.tree_util.keystr(k) for k, g in groups if g == "bias"]
    assert len(biased) == SMALL["num_hidden_layers"] and all("bqkv" in k for k in biased)
    attn = trainee.decoder.layers[0].attn
    w0, b0 = np.array(attn.wqkv[...]), np.array(attn.bqkv[...])
    batch = train.pack(random.Random(0), tokens.build(), cfg, 0)
    train.train_step(trainee, train.optimizer_for(trainee, cfg),
                     {k: jax.numpy.asarray(v) for k, v in batch.items()},
                     read_layer=1, read_weight=cfg.read_weight)  # fmt: skip
    moved_w = np.median(np.abs(np.asarray(attn.wqkv[...]) - w0))
    moved_b = np.median(np.abs(np.asarray(attn.bqkv[...]) - b0))
    assert moved_w == pytest.approx(1e-3, rel=0.05) and moved_b == pytest.approx(1e-2, rel=0.05)


def test_a_second_stage_starts_from_a_folder_and_refuses_another_shape(tmp_path):
    """--init: the trainee starts as the folder's model (the same logits; factored parts at
    zero), trains on, and a folder of another shape is refused by name."""
    cfg = train.TrainConfig(steps=2, rows=2, length=192, warmup=1, start=(2, 4), end=(2, 4),
                            read_layer=1, shape=tuple(SMALL.items()))  # fmt: skip
    first, _ = train.train(cfg, tmp_path / "a", progress=False)
    again = train.TrainConfig(**{**cfg.__dict__, "init": str(tmp_path / "a"), "seed": 5})
    trainee, _ = train.init(again)
    batch = train.rows_of(task.problems(0, 2, ops=(2, 2), rounds=(2, 3)), tokens.build())
    np.testing.assert_allclose(
        np.asarray(train.logits(trainee.model(), batch)),
        np.asarray(train.logits(first, batch)),
        atol=1e-5,
    )
    _, losses = train.train(again, tmp_path / "b", progress=False)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()
    wider = dict(SMALL, hidden_size=2 * SMALL["hidden_size"])
    other = train.TrainConfig(**{**again.__dict__, "shape": tuple(wider.items())})
    with pytest.raises(SystemExit, match=r"config.json: not this shape \(hidden_size"):
        train.init(other)
    with pytest.raises(SystemExit, match="no reasoner to start from"):
        train.init(train.TrainConfig(**{**again.__dict__, "init": str(tmp_path / "none")}))
