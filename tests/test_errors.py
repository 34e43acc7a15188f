"""Bad checkpoints and bad arguments fail early with errors that say what is wrong."""

import json
import re
import shutil
import socket

import numpy as np
import pytest
from rkvjax.convert.hf_config import ConfigError, parse_hf_config
from rkvjax.convert.hf_safetensors import CheckpointError
from safetensors.numpy import load_file, save_file

import rkvjax
from rkvjax import api
from rkvjax.entrypoints import cli


@pytest.fixture()
def folder(tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint("llama")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, fn):
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type.*yarn"),
        ({"quantization_config": {"bits": 4}}, "quantization_config"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"num_attention_heads": 3}, "multiple of kv_heads"),
    ],
)
def test_bad_config_names_the_key(folder, changes, match):
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=match):
        rkvjax.load(folder)


def test_qwen_sliding_window_layer_types_rejected():
    raw = {
        "model_type": "qwen2",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "rope_theta": 1e4,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    with pytest.raises(ConfigError, match="layer_types"):
        parse_hf_config(raw)


_LLAMA = {
    "model_type": "llama",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


def test_transformers4_rope_keys_accepted():
    raw = {
        **_LLAMA,
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = parse_hf_config(raw)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.factor == 8.0


def test_missing_tensor(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj"):
        rkvjax.load(folder)


def test_extra_tensor(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.mystery.weight": np.ones(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*mystery"):
        rkvjax.load(folder)


def test_misshaped_tensor(folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][
            :8
        ]

    _edit_tensors(folder, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(8, 64\), expected"):
        rkvjax.load(folder)


def test_missing_files(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        rkvjax.load(tmp_path / "nope")
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        rkvjax.load(folder)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return rkvjax.load(tiny_checkpoint("llama")[0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(method="lru"), "method must be one of"),
        (dict(max_new_tokens=600), "exceed the model's 512 positions"),
    ],
)
def test_bad_generate_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(model, [1, 2, 3], **kwargs)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([], "non-empty"),
        ([[1, 2], []], "prompt 1 is empty"),
        ([5, 97], r"token id\(s\) \[97\] outside the vocabulary"),
        ("hello", "no tokenizer.json"),
        ([1.5, 2.0], "expected a str, a list of token ids or a chat"),
    ],
)
def test_bad_prompts(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(model, prompts, max_new_tokens=2)


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ("", {}, "prompt 0: the prompt text is empty"),
        (["\ud800"], {}, "prompt 0: not valid Unicode text: a lone surrogate \\(U\\+D800\\)"),
        (
            [1, 2, 3],
            dict(sampling=rkvjax.SamplingParams(logprobs=98)),
            "prompt 0: logprobs=98 asks for more tokens than the vocabulary's 97",
        ),
        (
            [{"role": "user", "content": "x", "name": "al"}],
            {},
            "prompt 0: chat\\[0\\]: unknown key\\(s\\) 'name'",
        ),
        ([{"role": "wizard", "content": "x"}], {}, "prompt 0: chat\\[0\\]: unknown role 'wizard'"),
        ([{"role": "user"}], {}, "prompt 0: chat\\[0\\] has no `content`"),
        (
            [{"role": "user", "content": "x", "reasoning_content": "y"}],
            {},
            "prompt 0: chat\\[0\\]: `reasoning_content` belongs to an assistant message",
        ),
    ],
)
def test_bad_input_is_refused_before_work(model, prompts, kwargs, match):
    kwargs.setdefault("sampling", rkvjax.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(model, prompts, **kwargs)


def test_request_ids_must_be_hashable(model):
    engine = rkvjax.Engine(model, slots=1, cache=rkvjax.compression_config("rkv", 16))
    with pytest.raises(ValueError, match=r"request id \['x'\] is not hashable"):
        engine.submit([1, 2, 3, 4, 5, 6, 7, 8, 9], request_id=["x"])
    with pytest.raises(ValueError, match=r"samples must be distinct sample indices in \[0, 2\)"):
        engine.submit_many([[1] * 9], rkvjax.SamplingParams(n=2), samples=[[0, 2]])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "full", "--budget", "64"], "cache flags: --method full keeps every token"),
        (["--budget", "1"], "cache flags: budget=1 must be larger than window=8"),
        (["--budget", "4"], "cache flags: budget=4 must be larger than window=8"),
        (["--logprobs", "-1"], "sampling flags: logprobs"),
        (["--method-arg", "lamda=0.2"], "cache flags: --method-arg: method 'rkv' has no option"),
        (["--method-arg", "lam=high"], "cache flags: --method-arg: option lam must be float"),
        (["--method-arg", "lam=1.5"], "cache flags: lam must be in [0, 1], got 1.5"),
        (
            ["--method", "keydiff", "--budget", "64", "--method-arg", "kernel=3"],
            "cache flags: --method-arg: method",
        ),
        (["--method", "full", "--method-arg", "lam=0.2"], "cache flags: --method full has no"),
        (
            ["--budget", "64", "--method-arg", "lam=0.2", "--method-arg", "lam=0.9"],
            "cache flags: --method-arg: option lam given twice",
        ),
        (["--method-arg", "lam=0.2"], "cache flags: lam=0.2 would be ignored: without a budget"),
        (["--method", "snapkv"], "cache flags: --method snapkv compresses the cache to a --budget"),
    ],
)
def test_cli_refuses_bad_flags_before_loading(tmp_path, capsys, flags, message):
    argv = ["generate", "hello", "--model", str(tmp_path / "no-model"), *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"rkvjax: error: {message}" + err.split(message, 1)[1] and err.count("\n") == 1


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "prompt 0: the prompt text is empty"), ("\udcff", "prompt 0: not valid Unicode")],
)
def test_cli_refuses_bad_prompts_before_loading(tmp_path, capsys, prompt, message):
    """An empty prompt (batch refuses one too), and bytes that are not UTF-8 (Python passes
    them on as lone surrogates)."""
    assert cli.main(["generate", prompt, "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rkvjax: error: {message}") and err.count("\n") == 1


def test_cli_budget_reads_a_point_as_a_fraction():
    """One rule with `generate`'s: 1.0 is the whole length (a float), 1 is one token."""
    parse = cli.parser().parse_args
    assert parse(["generate", "x", "--budget", "1.0"]).budget == 1.0
    assert isinstance(parse(["generate", "x", "--budget", "0.1"]).budget, float)
    assert parse(["generate", "x", "--budget", "256"]).budget == 256
    assert isinstance(parse(["generate", "x", "--budget", "256"]).budget, int)
    for bad in ("256.0", "0.0", "-0.5", "x"):
        with pytest.raises(SystemExit):
            parse(["generate", "x", "--budget", bad])


def test_cli_eval_help_gives_its_own_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "0 = greedy (default: 0.6)" in text and "--top-p TOP_P (default: 0.95)" in text
    assert cli.parser().parse_args(["eval", "d", "o"]).temperature == 0.6


def test_bad_logits_and_load_arguments(model, folder):
    with pytest.raises(ValueError, match="equal lengths"):
        rkvjax.logits(model, [[1, 2], [3]])
    with pytest.raises(ValueError, match="token ids must lie"):
        rkvjax.logits(model, [1, 500])
    with pytest.raises(ValueError, match="dtype must be one of"):
        rkvjax.load(folder, dtype="float16")


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_rope_scaling_next_to_rope_parameters_is_not_ignored():
    """A YaRN `rope_scaling` added beside transformers-5 `rope_parameters` (transformers 5 lets it
    win) must not run plain RoPE."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    params = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type.*rope_scaling\.rope_type"):
        parse_hf_config({**_LLAMA, "rope_parameters": params, "rope_scaling": yarn})
    untyped = {"rope_theta": 1e4}
    with pytest.raises(ConfigError, match=r"rope_scaling\.rope_type` = 'yarn' is not supported"):
        parse_hf_config({**_LLAMA, "rope_parameters": untyped, "rope_scaling": yarn})


def test_conflicting_rope_theta_names_both_keys(folder):
    raw = {
        **_LLAMA,
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    with pytest.raises(
        ConfigError, match=r"`rope_parameters\.rope_theta` = 10000\.0 and `rope_theta`"
    ):
        parse_hf_config(raw)
    _edit_config(folder, rope_theta=123.0)  # next to the rope_parameters transformers wrote
    with pytest.raises(
        ConfigError, match=r"config\.json: `rope_parameters\.rope_theta`.*`rope_theta`"
    ):
        rkvjax.load(folder)


def test_rope_keys_given_twice_and_consistent_are_accepted():
    raw = {
        **_LLAMA,
        "rope_theta": 500000,
        "rope_parameters": {**_LLAMA3_SCALING, "rope_theta": 5e5},
        "rope_scaling": dict(_LLAMA3_SCALING),
    }
    cfg = parse_hf_config(raw)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.factor == 8.0
    legacy = {**_LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "default"}}
    assert parse_hf_config(legacy).rope_scaling is None


def _add_tokenizer(folder):
    """A word-level tokenizer.json and tokenizer_config.json beside the tiny model."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = ["<unk>", "<s>", "</s>", "hi"]
    Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json")
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# (file, how it is broken, what the message must say besides the file's name)
_BROKEN = {
    "truncated_weights": ("model.safetensors", lambda p: _truncate(p), "truncated"),
    "weights_header_cut": ("model.safetensors", lambda p: _truncate(p, 0.0001), "truncated"),
    "config_not_json": ("config.json", lambda p: p.write_text('{"model_type": "llama",'), "JSON"),
    "config_a_list": ("config.json", lambda p: p.write_text("[1, 2]"), "JSON object"),
    "config_binary": ("config.json", lambda p: p.write_bytes(b"\xff\xfe\x00\xd8"), "JSON"),
    "tokenizer_config_not_json": (
        "tokenizer_config.json",
        lambda p: p.write_text("{'a': 1}"),
        "JSON",
    ),
    "tokenizer_config_a_string": ("tokenizer_config.json", lambda p: p.write_text('"x"'), "object"),
    "special_tokens_map_not_json": ("special_tokens_map.json", lambda p: p.write_text("{"), "JSON"),
    "tokenizer_json_garbage": ("tokenizer.json", lambda p: p.write_text("[1]"), "tokenizers"),
    "generation_config_not_json": ("generation_config.json", lambda p: p.write_text("}"), "JSON"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_broken_file_gives_one_line_naming_it(folder, case, capsys, monkeypatch):
    monkeypatch.setenv("RKVJAX_COMPILE_CACHE", "0")
    name, breakage, match = _BROKEN[case]
    _add_tokenizer(folder)
    breakage(folder / name)
    with pytest.raises(ValueError, match=match) as err:
        rkvjax.load(folder)
    assert str(folder / name) in str(err.value)
    argv = ["generate", "hi", "--model", str(folder), "--max-new-tokens", "1"]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rkvjax: error: "), lines
    assert str(folder / name) in lines[0]


def test_broken_index_file_names_it(folder):
    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=re.escape(f"{index}: not valid JSON")):
        rkvjax.load(folder)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=re.escape(f"{index}: lists missing.safetensors")):
        rkvjax.load(folder)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed="x"), "seed must be an int"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(stop_token_ids=[97]), r"stop_token_ids: token id 97 is outside the vocabulary"),
        (dict(stop_token_ids=["a"]), "stop_token_ids must be a list of ints"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be a positive int"),
    ],
)
def test_bad_sampling_arguments_name_the_setting(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(model, [1, 2, 3], **kwargs)


def test_numpy_token_ids_are_prompts(model):
    """A 1-D integer array is one prompt, a 2-D one a batch, exactly like the lists."""
    ids = np.array([5, 6, 7, 8], np.int64)
    kw = dict(max_new_tokens=3, slots=2)  # one engine for all three calls
    want = rkvjax.generate(model, ids.tolist(), **kw)
    assert rkvjax.generate(model, ids, **kw).token_ids == want.token_ids
    two = rkvjax.generate(model, np.stack([ids, ids + 1]), **kw)
    assert len(two) == 2 and two[0].token_ids == want.token_ids
    with pytest.raises(ValueError, match="1-D or 2-D integer token ids"):
        rkvjax.generate(model, np.zeros((2, 2), np.float32), max_new_tokens=3)


def test_a_budget_beyond_the_context_is_refused_before_the_weights_load(
    tiny_checkpoint, model, capsys, monkeypatch
):
    """A cache larger than the model's positions could never fill (and allocated until XLA ran
    out of memory): refused from config.json, naming the context, in every command."""
    folder = str(tiny_checkpoint("llama")[0])
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the weights loaded"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    for argv in (
        ["generate", "hi", "--model", folder, "--budget", "100000", "--no-chat"],
        ["serve", "--model", folder, "--budget", "1000", "--port", port],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("rkvjax: error: cache flags: budget=") and err.count("\n") == 1
        assert "exceed the model's context of 512 positions" in err
        assert "a budget of at most 384 fits" in err
    cc = rkvjax.compression_config("rkv", 600)
    with pytest.raises(ValueError, match="budget=600 \\+ buffer=128 cache slots exceed"):
        rkvjax.Engine(model, slots=1, cache=cc)
