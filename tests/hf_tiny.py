"""Tiny random-init Hugging Face checkpoints (transformers is a test-only dependency)."""

from pathlib import Path

import torch
import transformers as tf

VOCAB = 97
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so test positions reach all three bands
}

_MOE = dict(
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    norm_topk_prob=True,
)

KINDS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    # One layer: for tests that compile many engine configurations (batch invariance).
    "llama_1layer": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(num_hidden_layers=1)),
    "llama3_rope": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(rope_scaling=_LLAMA3)),
    "llama_mha_tied_bias": (
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True),
    ),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen2_gqa3": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        dict(
            num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True
        ),
    ),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
    # 8 experts, top 2, renormalised; layer 0 dense through mlp_only_layers, layer 1 experts.
    # 4 KV heads so that a model=4 mesh splits it.
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, {**_MOE, "mlp_only_layers": [0]}),
    # Experts in every layer, as llama.cpp's qwen3moe (GGUF) has them.
    "qwen3_moe_sparse": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, _MOE),
}


def build(kind: str, folder: Path, seed: int = 0):
    """Saves a random `kind` checkpoint to `folder` (safetensors) and returns the torch model."""
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **extra})).eval()
    with torch.no_grad():
        # Larger than the default init so logits are far from uniform and argmax ties are rare.
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return model
