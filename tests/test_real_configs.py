"""The published config.json files of the target checkpoints: each is accepted and builds a model
of the published size, and real configs of models this engine does not run are refused.

The files live outside the repository, in shared/data/real_configs next to it (SOURCES.md there
says where each came from); the unverified/ folder is not used. Without that folder the tests
skip (`tests/shared_data.py`).
"""

import json
import math
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, Decimal
from pathlib import Path

import jax
import pytest
from flax import nnx
from rkvjax.convert.hf_config import ConfigError, parse_hf_config
from rkvjax.models.decoder import abstract_decoder

from tests import shared_data

REAL = shared_data.SHARED_DATA / "real_configs"

HF_SIZE = "Safetensors 'Model size' on huggingface.co/{}"
CARD = "'Number of Parameters' in the model card, huggingface.co/{}"
# File stem -> (Hugging Face repo, [(published figure, what it counts, source)]). "total" is
# every parameter, a tied embedding once; "non-embedding" leaves out the embedding and lm_head;
# "stored" counts a tied embedding twice, as a checkpoint that saves lm_head.weight too does
# (Qwen3-0.6B's safetensors file does). Cards round or truncate to the digits they print.
PUBLISHED = {
    "DeepSeek-R1-Distill-Llama-8B": (
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        [("8.03B", "total", HF_SIZE)],
    ),
    "DeepSeek-R1-Distill-Qwen-1.5B": (
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        [("1.78B", "total", HF_SIZE)],
    ),
    "DeepSeek-R1-Distill-Qwen-7B": (
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        [("7.62B", "total", HF_SIZE)],
    ),
    "DeepSeek-R1-Distill-Qwen-32B": (
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
        [("32.8B", "total", HF_SIZE)],
    ),
    "Llama-3.1-8B": ("meta-llama/Llama-3.1-8B", [("8.03B", "total", HF_SIZE)]),
    "Llama-3.1-8B-Instruct": ("meta-llama/Llama-3.1-8B-Instruct", [("8.03B", "total", HF_SIZE)]),
    "Qwen2.5-0.5B-Instruct": (
        "Qwen/Qwen2.5-0.5B-Instruct",
        [("0.49B", "total", CARD), ("0.36B", "non-embedding", CARD)],
    ),
    "Qwen2.5-1.5B-Instruct": (
        "Qwen/Qwen2.5-1.5B-Instruct",
        [("1.54B", "total", CARD), ("1.31B", "non-embedding", CARD)],
    ),
    "Qwen2.5-3B-Instruct": (
        "Qwen/Qwen2.5-3B-Instruct",
        [("3.09B", "total", CARD), ("2.77B", "non-embedding", CARD)],
    ),
    "Qwen2.5-7B-Instruct": (
        "Qwen/Qwen2.5-7B-Instruct",
        [("7.61B", "total", CARD), ("6.53B", "non-embedding", CARD)],
    ),
    "Qwen3-0.6B": (
        "Qwen/Qwen3-0.6B",
        [("0.6B", "total", CARD), ("0.44B", "non-embedding", CARD), ("0.75B", "stored", HF_SIZE)],
    ),
    "Qwen3-8B": (
        "Qwen/Qwen3-8B",
        [("8.2B", "total", CARD), ("6.95B", "non-embedding", CARD), ("8.19B", "total", HF_SIZE)],
    ),
    "Qwen3-14B": ("Qwen/Qwen3-14B", [("14.8B", "total", CARD), ("13.2B", "non-embedding", CARD)]),
    "Qwen3-32B": ("Qwen/Qwen3-32B", [("32.8B", "total", CARD), ("31.2B", "non-embedding", CARD)]),
    "TinyLlama-1.1B-Chat-v1.0": (
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        [("1.1B", "total", HF_SIZE)],
    ),
    # 134,515,008 parameters exactly.
    "SmolLM2-135M-Instruct": (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        [("135M", "total", HF_SIZE)],
    ),
}

# moe/ file stem -> (repo, [(figure, what, source)]); "active" is what one token uses.
MOE = {
    "Qwen3-30B-A3B": (
        "Qwen/Qwen3-30B-A3B",
        [("30.5B", "total", CARD), ("29.9B", "non-embedding", CARD), ("3.3B", "active", CARD)],
    ),
}

# refuse/ file stem -> what its message must name: first as published, then with the
# architecture swapped for a supported one (so the other reasons are caught on their own too).
REFUSED = {
    "gpt-oss-20b": ("model_type 'gpt_oss'", "llama", ["quantization_config", "num_local_experts"]),
    "Magistral-Small-2509": ("model_type 'mistral3'", "llama", ["text_config", "vision_config"]),
    "Qwen3-Next-80B-A3B-Instruct": (
        "model_type 'qwen3_next'",
        "qwen3",
        ["num_experts", "linear_num_key_heads", "partial_rotary_factor"],
    ),
}
_SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _read(path: Path) -> dict:
    shared_data.need("real_configs")
    return json.loads(path.read_text(encoding="utf-8"))


def _matches(count: int, figure: str) -> bool:
    """Whether `count` printed to `figure`'s digits, rounded or truncated, gives `figure`."""
    scale = {"B": Decimal(10) ** 9, "M": Decimal(10) ** 6}[figure[-1]]
    published = Decimal(figure[:-1])
    value = Decimal(count) / scale
    step = Decimal(1).scaleb(published.as_tuple().exponent)
    return published in (value.quantize(step, ROUND_HALF_EVEN), value.quantize(step, ROUND_DOWN))


def _sizes(cfg) -> dict[str, int]:
    """Parameter counts of the abstract model (no weights allocated)."""
    state = nnx.state(abstract_decoder(cfg))
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    total = sum(math.prod(x.shape) for x in leaves)
    heads = [state["embed"]] + ([] if cfg.tie_embeddings else [state["lm_head"]])
    embedding = sum(math.prod(x.shape) for x in jax.tree.leaves(heads))
    tied_copy = cfg.vocab_size * cfg.embed if cfg.tie_embeddings else 0
    return {"total": total, "non-embedding": total - embedding, "stored": total + tied_copy}


def test_table_covers_every_config():
    shared_data.need("real_configs")
    assert {p.stem for p in REAL.glob("*.json")} == PUBLISHED.keys()
    assert {p.stem for p in (REAL / "moe").glob("*.json")} == MOE.keys()
    assert {p.stem for p in (REAL / "refuse").glob("*.json")} == REFUSED.keys()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_config_builds_the_published_size(name):
    raw = _read(REAL / f"{name}.json")
    cfg = parse_hf_config(raw, where=name)
    assert cfg.tie_embeddings == raw.get("tie_word_embeddings", False)
    sizes = _sizes(cfg)
    repo, figures = PUBLISHED[name]
    for figure, what, source in figures:
        assert _matches(sizes[what], figure), (
            f"{name}: {what} {sizes[what]:,} parameters, published {figure} ({source.format(repo)})"
        )


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_config_builds_the_published_size_and_active_size(name):
    cfg = parse_hf_config(_read(REAL / "moe" / f"{name}.json"), where=name)
    assert cfg.experts is not None and len(cfg.experts.layers) == cfg.num_layers
    sizes = _sizes(cfg)
    assert cfg.parameters() == sizes["total"]
    sizes["active"] = cfg.parameters(active=True)
    assert cfg.describe() == "qwen3_moe, 3.35B of 30.5B parameters active"  # commands' first line
    repo, figures = MOE[name]
    for figure, what, source in figures:
        assert _matches(sizes[what], figure), (
            f"{name}: {what} {sizes[what]:,} parameters, published {figure} ({source.format(repo)})"
        )


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_of_the_config_is_the_models(name):
    cfg = parse_hf_config(_read(REAL / f"{name}.json"), where=name)
    assert cfg.parameters() == cfg.parameters(active=True) == _sizes(cfg)["total"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_config_of_another_model_is_refused(name):
    raw = _read(REAL / "refuse" / f"{name}.json")
    reason, arch, keys = REFUSED[name]
    with pytest.raises(ConfigError, match=reason):
        parse_hf_config(raw, where=name)
    as_supported = {**raw, "model_type": arch, "architectures": [_SUPPORTED[arch]]}
    with pytest.raises(ConfigError, match="unsupported config key") as err:
        parse_hf_config(as_supported, where=name)
    for key in keys:
        assert f"'{key}'" in str(err.value), key


def _smol() -> dict:
    return _read(REAL / "SmolLM2-135M-Instruct.json")


@pytest.mark.parametrize(
    "extra",
    [
        {"transformers.js_config": {"kv_cache_dtype": {"fp16": "float16"}}},
        {"_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "unk_token_id": 0},
        {"sep_token_id": 3, "cls_token_id": 4},
        {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}},
        {"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "_commit_hash": "abc"},
    ],
    ids=["js_config", "from_gguf", "token_ids", "labels", "private"],
)
def test_metadata_keys_are_let_through(extra):
    raw = _smol()
    assert parse_hf_config({**raw, **extra}) == parse_hf_config(raw)


# Settings that change the math stay refused, named: those of the refused files above, each
# added alone to a config that is accepted, and a few more.
_GPT_OSS, _MAGISTRAL, _NEXT = "gpt-oss-20b", "Magistral-Small-2509", "Qwen3-Next-80B-A3B-Instruct"


@pytest.mark.parametrize(
    "source, key, match",
    [
        (_GPT_OSS, "quantization_config", "quantization_config"),
        (_GPT_OSS, "num_local_experts", "num_local_experts"),
        (_GPT_OSS, "layer_types", "layer_types"),
        (_GPT_OSS, "rope_scaling", r"rope_scaling\.rope_type` = 'yarn'"),
        (_MAGISTRAL, "text_config", "text_config"),
        (_MAGISTRAL, "vision_config", "vision_config"),
        (_NEXT, "num_experts", "num_experts"),
        (_NEXT, "full_attention_interval", "full_attention_interval"),
        (_NEXT, "partial_rotary_factor", "partial_rotary_factor"),
    ],
)
def test_settings_that_change_the_math_are_refused(source, key, match):
    value = _read(REAL / "refuse" / f"{source}.json")[key]
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**_smol(), key: value})


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "'linear' is not supported"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"num_experts_per_tok": 2}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_other_math_settings_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**_smol(), **extra})


@pytest.mark.slow
def test_config_transformers_writes_from_a_gguf_is_accepted(tmp_path):
    """transformers' own config for the default model's GGUF (it adds `_model_name_or_path` and
    `unk_token_id`) describes the same model as the published config."""
    from rkvjax.convert.default_model import default_gguf_path
    from transformers import AutoConfig

    gguf = default_gguf_path()
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {"_model_name_or_path", "unk_token_id"} <= written.keys()
    cfg = parse_hf_config(written)
    assert _sizes(cfg) == _sizes(parse_hf_config(_smol()))
