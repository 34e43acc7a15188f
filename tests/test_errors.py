"""Bad checkpoints and bad arguments fail early with errors that say what is wrong."""

import json
import shutil

import numpy as np
import pytest
from rkvjax.convert.hf_config import ConfigError, parse_hf_config
from rkvjax.convert.hf_safetensors import CheckpointError
from safetensors.numpy import load_file, save_file

import rkvjax


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


def test_transformers4_rope_keys_accepted():
    raw = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
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
        (dict(method="h2o"), "method must be one of"),
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
        ([1.5, 2.0], "expected a str or a list of token ids"),
    ],
)
def test_bad_prompts(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        rkvjax.generate(model, prompts, max_new_tokens=2)


def test_bad_logits_and_load_arguments(model, folder):
    with pytest.raises(ValueError, match="equal lengths"):
        rkvjax.logits(model, [[1, 2], [3]])
    with pytest.raises(ValueError, match="token ids must lie"):
        rkvjax.logits(model, [1, 500])
    with pytest.raises(ValueError, match="dtype must be one of"):
        rkvjax.load(folder, dtype="float16")
