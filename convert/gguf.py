"""GGUF (llama.cpp) file -> Hugging Face folder: config, float32 safetensors, tokenizer files.

Architectures: llama, qwen2, qwen3 and qwen3moe (Qwen3-MoE), each as llama.cpp's
convert_hf_to_gguf.py writes it: Q/K rows permuted for llama only (the others use NEOX RoPE,
which is Hugging Face's rotate-half), q/k/v biases for qwen2, q/k norms for qwen3 and qwen3moe,
and a qwen3moe layer's experts stacked in one tensor per projection ([E, F, D]), split back into
Hugging Face's per-expert tensors."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np

# Bump whenever the output of gguf_to_hf changes, so cached conversions are redone.
CONVERTER_VERSION = 1
STAMP_FILE = "rkvjax_conversion.json"

# llama.cpp `tokenizer.ggml.pre` -> how text is split before byte-level BPE. llama-vocab.cpp gives
# smollm and starcoder the regexes ["\p{N}", <GPT-2 regex>] (tokenizer.json: Digits(individual) +
# ByteLevel), gpt-2 [<GPT-2 regex>] (ByteLevel with its regex) and qwen2 its own one regex
# (tokenizer.json: Split(regex, isolated) + ByteLevel without regex).
_PRE_SPLITS = {"smollm": "digits", "starcoder": "digits", "gpt-2": "gpt2", "qwen2": "qwen2"}
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _Arch(NamedTuple):
    """What a llama.cpp architecture stores beyond a llama's, and the Hugging Face model it is."""

    model_type: str
    architecture: str
    permuted_qk: bool  # Q/K rows in llama.cpp's interleaved-RoPE order (llama only)
    qkv_bias: bool
    qk_norm: bool
    experts: bool  # every layer a mixture of experts (llama.cpp has no dense layers among them)


_ARCHS = {
    "llama": _Arch("llama", "LlamaForCausalLM", True, False, False, False),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", False, True, False, False),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", False, False, True, False),
    "qwen3moe": _Arch("qwen3_moe", "Qwen3MoeForCausalLM", False, False, True, True),
}

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (plain added).
_CONTROL, _USER_DEFINED = 3, 4

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # Stacked experts, split along axis 0 into one tensor per expert `e`.
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into an exact Hugging Face checkpoint."""


def gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Converts a llama, qwen2, qwen3 or qwen3moe GGUF file into a Hugging Face style folder.

    Quantized tensors are dequantized to float32, llama.cpp's Q/K row permutation is undone
    (llama) and stacked experts are split (qwen3moe), so the matching transformers model
    (`LlamaForCausalLM`, ...) loaded from `out_dir` computes what llama.cpp computes. The folder
    is built next to `out_dir` and renamed into place, so it is either complete or absent.

    Args:
        gguf_path: the .gguf file.
        out_dir: folder to create; holds config.json, generation_config.json, model.safetensors,
            tokenizer.json, tokenizer_config.json and a conversion stamp (STAMP_FILE).
        overwrite: replace an existing non-empty `out_dir` that an earlier conversion wrote (it
            has STAMP_FILE) instead of raising FileExistsError; any other folder is refused.

    Returns:
        `out_dir` as a Path.
    """
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    _check_replaceable(out_dir, overwrite)
    where = gguf_path.name
    with _GGUFFile(gguf_path) as reader:
        meta = reader.meta
        arch = meta.get("general.architecture")
        if arch not in _ARCHS:
            raise GGUFError(
                f"{where}: architecture {arch!r} is not supported by the GGUF converter "
                f"(supported: {', '.join(map(repr, _ARCHS))}); convert the original Hugging Face "
                "checkpoint instead"
            )
        config = _config(meta, arch, [t.name for t in reader.tensors], where)
        tokenizer_json, tokenizer_config = _tokenizer_files(meta, config, where)
        tensors = _tensors(reader, _ARCHS[arch], config, where)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp, which makes it 0700) so the folder gets the usual umask permissions.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", config)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        # safetensors creates the file 0600; give it the same mode as the JSON files.
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        stamp = {
            "converter_version": CONVERTER_VERSION,
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
        }
        _write_json(tmp / STAMP_FILE, stamp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Refuses to write over anything but an absent or empty folder or, with `overwrite`, an
    earlier conversion: the folder is replaced whole, so it must be one this converter made."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    if not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True to replace)")
    if not (out_dir / STAMP_FILE).is_file():
        raise FileExistsError(
            f"{out_dir} exists and was not written by the GGUF converter (no {STAMP_FILE}); "
            "overwrite replaces only such folders: choose another output folder"
        )


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on Q/K rows: interleaved RoPE -> HF rotate-half.

    llama.cpp stores each head's rows as (pair, half) where HF stores (half, pair).

    Args:
        w: [n_head * head_dim, in] as stored in the GGUF (dequantized).
        n_head: number of heads in `w` (query heads for Q, KV heads for K).

    Returns:
        [n_head * head_dim, in] in Hugging Face row order.
    """
    out, rest = w.shape[0], w.shape[1:]
    if out % (2 * n_head):
        raise GGUFError(f"cannot un-permute {w.shape}: {out} rows is not a multiple of 2*{n_head}")
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _f32(x: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the shortest float32 spelling.
    return float(str(np.float32(x)))


def _config(meta: dict[str, Any], arch: str, names: list[str], where: str) -> dict[str, Any]:
    """config.json as transformers 5 `<Model>Config.save_pretrained` writes it (llama exactly;
    the Qwen families with the keys their models read)."""
    spec = _ARCHS[arch]

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{where}: metadata key {arch}.{key} is missing")
        return meta[f"{arch}.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{where}: attention.value_length differs from key_length")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{where}: partial RoPE (rope.dimension_count != head_dim) is unsupported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFError(f"{where}: {arch}.rope.scaling.type {scaling!r} is unsupported")
    if get("expert_count", 0) and not spec.experts:
        raise GGUFError(f"{where}: mixture-of-experts {arch} files are unsupported")
    if get("expert_shared_count", 0):
        raise GGUFError(f"{where}: shared experts ({arch}.expert_shared_count) are unsupported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
    if vocab == 0:
        raise GGUFError(f"{where}: no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")

    def token_id(key):
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    moe: dict[str, Any] = {}
    if spec.experts:
        experts = int(need("expert_count"))
        ffw = int(need("expert_feed_forward_length"))
        moe = {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": ffw,
            # llama.cpp renormalises a qwen3moe token's top-k weights unless told otherwise.
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "num_experts": experts,
            "num_experts_per_tok": int(need("expert_used_count")),
        }
    config = {
        "architectures": [spec.architecture],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id("bos_token_id"),
        "dtype": "float32",
        "eos_token_id": token_id("eos_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        # A qwen3moe file may leave out the dense size (every layer has experts).
        "intermediate_size": int(get("feed_forward_length", moe.get("moe_intermediate_size", 0)))
        if spec.experts
        else int(need("feed_forward_length")),
        "max_position_embeddings": int(need("context_length")),
        "mlp_bias": False,
        "model_type": spec.model_type,
        "num_attention_heads": heads,
        "num_hidden_layers": int(need("block_count")),
        "num_key_value_heads": kv_heads,
        "pad_token_id": token_id("padding_token_id"),
        "pretraining_tp": 1,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_theta": _f32(get("rope.freq_base", 10000.0)),
            "rope_type": "default",
        },
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "use_cache": True,
        "vocab_size": vocab,
        **moe,
    }
    if arch != "llama":  # keys only LlamaConfig has (Qwen2 always biases q/k/v)
        for key in ("mlp_bias", "pretraining_tp", *(["attention_bias"] if spec.qkv_bias else [])):
            del config[key]
    return dict(sorted(config.items()))


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config[k] is not None}


def _expected_shapes(arch: _Arch, config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (HF numpy shape [out, in], HF name; `{e}` in it: split per expert)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h, n, k = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    spec = {
        "token_embd.weight": ((v, d), "model.embed_tokens.weight"),
        "output_norm.weight": ((d,), "model.norm.weight"),
    }
    if not config["tie_word_embeddings"]:
        spec["output.weight"] = ((v, d), "lm_head.weight")
    shapes = {
        "attn_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "attn_q.weight": (n * h, d),
        "attn_k.weight": (k * h, d),
        "attn_v.weight": (k * h, d),
        "attn_output.weight": (d, n * h),
    }
    if arch.qkv_bias:
        shapes.update({"attn_q.bias": (n * h,), "attn_k.bias": (k * h,), "attn_v.bias": (k * h,)})
    if arch.qk_norm:
        shapes.update({"attn_q_norm.weight": (h,), "attn_k_norm.weight": (h,)})
    if arch.experts:
        e, fe = config["num_experts"], config["moe_intermediate_size"]
        shapes.update({
            "ffn_gate_inp.weight": (e, d),
            "ffn_gate_exps.weight": (e, fe, d),
            "ffn_up_exps.weight": (e, fe, d),
            "ffn_down_exps.weight": (e, d, fe),
        })  # fmt: skip
    else:
        shapes.update({"ffn_gate.weight": (f, d), "ffn_up.weight": (f, d)})
        shapes["ffn_down.weight"] = (d, f)
    for i in range(config["num_hidden_layers"]):
        for name, shape in shapes.items():
            spec[f"blk.{i}.{name}"] = (shape, f"model.layers.{i}.{_LAYER_NAMES[name]}")
    return spec


def _tensors(
    reader: _GGUFFile, arch: _Arch, config: dict[str, Any], where: str
) -> dict[str, np.ndarray]:
    spec = _expected_shapes(arch, config)
    out: dict[str, np.ndarray] = {}
    seen = set()
    for t in reader.tensors:
        if t.name not in spec:
            raise GGUFError(f"{where}: unexpected tensor {t.name!r} (shape {t.shape})")
        if t.name in seen:
            raise GGUFError(f"{where}: tensor {t.name!r} appears twice")
        seen.add(t.name)
        shape, hf_name = spec[t.name]
        if t.shape != shape:
            raise GGUFError(f"{where}: tensor {t.name!r} has shape {t.shape}, expected {shape}")
        w = reader.float32(t)
        layer = _LAYER.fullmatch(t.name)
        kind = layer.group(2) if layer else None
        if arch.permuted_qk and kind == "attn_q.weight":
            w = unpermute_rows(w, config["num_attention_heads"])
        elif arch.permuted_qk and kind == "attn_k.weight":
            w = unpermute_rows(w, config["num_key_value_heads"])
        if "{e}" in hf_name:
            for e, we in enumerate(w):
                out[hf_name.format(e=e)] = np.ascontiguousarray(we)
        else:
            out[hf_name] = np.ascontiguousarray(w)
    missing = [name for name in spec if name not in seen]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise GGUFError(f"{where}: tensor {missing[0]!r}{more} is missing")
    return out


def _tokenizer_files(meta: dict[str, Any], config: dict[str, Any], where: str):
    """(tokenizer.json text, tokenizer_config dict) reproducing the model's HF tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise GGUFError(
            f"{where}: tokenizer.ggml.model {model!r} is unsupported (supported: 'gpt2', i.e. "
            "byte-level BPE)"
        )
    if pre not in _PRE_SPLITS:
        raise GGUFError(
            f"{where}: tokenizer.ggml.pre {pre!r} is unsupported (supported: {sorted(_PRE_SPLITS)})"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges_raw = list(meta.get("tokenizer.ggml.merges") or [])
    if len(tokens) != config["vocab_size"] or len(types) != len(tokens):
        raise GGUFError(
            f"{where}: {len(tokens)} tokens and {len(types)} token types for vocab_size "
            f"{config['vocab_size']}"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{where}: the vocabulary has duplicate tokens")
    merges = []
    for m in merges_raw:
        pair = tuple(m.split(" "))
        if len(pair) != 2:
            raise GGUFError(f"{where}: malformed merge {m!r}")
        merges.append(pair)

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS[pre]
    if split == "qwen2":  # the regex splits; byte-level only maps bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])  # fmt: skip
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
        tok.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if split == "digits"
            else byte_level
        )
    tok.decoder = decoders.ByteLevel()

    def token_of(key):
        value = meta.get(f"tokenizer.ggml.{key}")
        return None if value is None else tokens[int(value)]

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    if add_bos or add_eos:
        ends = [("bos_token_id", add_bos), ("eos_token_id", add_eos)]
        specials = [(token_of(key), meta.get(f"tokenizer.ggml.{key}")) for key, on in ends if on]
        if any(i is None for _, i in specials):
            raise GGUFError(f"{where}: add_bos/add_eos_token is set but the token id is missing")
        specials = [(s, int(i)) for s, i in specials]
        single = ["$A:0"]
        if add_bos:
            single.insert(0, f"{specials[0][0]}:0")
        if add_eos:
            single.append(f"{specials[-1][0]}:0")
        post.append(processors.TemplateProcessing(single=single, special_tokens=specials))
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    added = [
        (i, AddedToken(t, special=ty == _CONTROL, normalized=False))
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_special_tokens([a for _, a in added if a.special])
    tok.add_tokens([a for _, a in added if not a.special])

    tokenizer_config: dict[str, Any] = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": a.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": a.special,
            }
            for i, a in added
        },
        "bos_token": token_of("bos_token_id"),
        "clean_up_tokenization_spaces": False,
        "eos_token": token_of("eos_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "pad_token": token_of("padding_token_id"),
        # Not GPT2Tokenizer (what the Hub repos say): transformers 5 rebuilds that class from the
        # vocab with its own pre-tokenizer, dropping the Digits split; this keeps tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": token_of("unknown_token_id"),
    }
    if add_bos or add_eos:
        tokenizer_config["add_bos_token"] = add_bos
        tokenizer_config["add_eos_token"] = add_eos
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
    return tok.to_str(pretty=True), tokenizer_config


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Moves the finished `tmp` to `out_dir`, replacing an old `out_dir` if there is one."""
    if out_dir.exists():
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "dir")
            try:
                os.rename(tmp, out_dir)
            except OSError:
                os.rename(old / "dir", out_dir)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
            return
    try:
        os.rename(tmp, out_dir)
    except OSError as e:
        # Another process finished the same folder between our check and the rename.
        raise FileExistsError(f"{out_dir} appeared while converting") from e


class _Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), the reverse of GGUF's
    ggml_type: int
    offset: int  # from the start of the data section


class _GGUFFile:
    """A GGUF v2/v3 file, memory-mapped: metadata and tensor table parsed on open.

    gguf-py's GGUFReader takes ~5 s on this 100 MB file (it slices a np.memmap once per string of
    the 49k-token vocabulary); struct on a plain mmap takes ~0.1 s. Dequantization is gguf-py's.
    """

    # GGUF metadata value type -> struct format (8 = string and 9 = array are handled apart).
    _SCALARS: ClassVar[dict[int, str]] = {
        0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
        12: "<d",
    }  # fmt: skip

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 -- closed in close()
        try:
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse()
        except GGUFError:
            self.close()
            raise
        except (ValueError, KeyError, IndexError, struct.error) as e:  # truncated or garbage
            self.close()
            raise GGUFError(f"{path.name}: not a readable GGUF file ({e})") from e
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> _GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_mm", None) is not None:
            with contextlib.suppress(BufferError):
                # An array view still alive (e.g. held by a traceback) pins the map: let GC unmap.
                self._mm.close()
            self._mm = None
        self._file.close()

    def _parse(self) -> None:
        where = self.path.name
        if self._mm[:4] != b"GGUF":
            raise GGUFError(f"{where}: not a GGUF file (magic {bytes(self._mm[:4])!r})")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise GGUFError(f"{where}: GGUF version {version} is unsupported (need 2 or 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._scalar(4))
        self.tensors: list[_Tensor] = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            ggml_type, offset = self._scalar(4), self._scalar(10)
            self.tensors.append(_Tensor(name, tuple(reversed(dims)), ggml_type, offset))
        align = int(self.meta.get("general.alignment", 32))
        self._data_start = -(-self._pos // align) * align

    def _scalar(self, value_type: int):
        fmt = self._SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        text = self._mm[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return text

    def _value(self, value_type: int):
        if value_type == 8:
            return self._string()
        if value_type == 9:
            item_type, count = self._scalar(4), self._scalar(10)
            return [self._value(item_type) for _ in range(count)]
        if value_type not in self._SCALARS:
            raise GGUFError(f"{self.path.name}: unknown metadata value type {value_type}")
        return self._scalar(value_type)

    def float32(self, t: _Tensor) -> np.ndarray:
        """The tensor as a float32 array of `t.shape`, dequantized by gguf-py."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            qtype = GGMLQuantizationType(t.ggml_type)
        except ValueError:
            msg = f"{self.path.name}: tensor {t.name!r} has unknown type {t.ggml_type}"
            raise GGUFError(msg) from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = int(np.prod(t.shape[:-1])), t.shape[-1]
        if cols % block:
            raise GGUFError(f"{self.path.name}: tensor {t.name!r} rows split a {qtype.name} block")
        row_bytes = cols // block * block_bytes
        start = self._data_start + t.offset
        if start + rows * row_bytes > len(self._mm):
            raise GGUFError(f"{self.path.name}: tensor {t.name!r} runs past the end of the file")
        raw = np.frombuffer(self._mm, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
        try:
            w = dequantize(raw, qtype)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path.name}: tensor {t.name!r}: {e}") from None
        # Copy: the result must not keep a view of the mmap, which is closed after conversion.
        return np.array(w, dtype=np.float32, copy=True).reshape(t.shape)
