"""Random-init Hugging Face checkpoints of named shapes, for benchmarks that need no trained
weights: the CI smoke runs (`tiny`) and speed runs of models too large to ship here.

    python -m bench.checkpoints r1-distill-qwen-1.5b /tmp/q15 --dtype bfloat16

Speed does not depend on the weights' values, so a random model of the right shape decodes as
fast as the trained one. Needs torch and transformers (the `test` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# name -> (transformers config class, model class, config keywords)
SHAPES = {
    # A small Llama (GQA, tied embeddings): compiles in seconds.
    "tiny": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
    ),
    # The default model's shape (SmolLM2-135M-Instruct).
    "smollm2-135m": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    # DeepSeek-R1-Distill-Qwen-1.5B, the paper's smallest reasoning model.
    "r1-distill-qwen-1.5b": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=131072,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}


def save(shape: str, folder: Path, *, dtype: str = "float32", std: float = 0.2, seed: int = 0):
    """Saves a random `shape` checkpoint (safetensors) to `folder` and returns the folder.

    Weights are N(0, std): the default init gives near-uniform logits, where every compression
    method would pick the same tokens.
    """
    import torch
    import transformers as tf

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    config_cls, model_cls, kw = SHAPES[shape]
    cfg = getattr(tf, config_cls)(**kw, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    # Built on the GPU when there is one: initialising a 1.5B model on a few CPU cores is slow.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = getattr(tf, model_cls)(cfg).to(getattr(torch, dtype))
    with torch.no_grad():
        for w in model.parameters():
            w.normal_(0.0, std)
    model.save_pretrained(folder)
    return Path(folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=list(SHAPES))
    p.add_argument("folder", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--std", type=float, default=0.2, help="weights are N(0, std)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    print(save(args.shape, args.folder, dtype=args.dtype, std=args.std))


if __name__ == "__main__":
    main()
