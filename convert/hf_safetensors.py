"""Hugging Face safetensors -> Decoder weights, checked tensor by tensor against the spec tree.

Files are memory-mapped and read per tensor (NumPy + ml_dtypes, so bfloat16 works and torch is
never needed); each tensor is checked, reshaped into our layout and placed on device before the next
is read (a layer's q, k and v together: they form one weight), so host memory never holds the
whole model twice. On a mesh each tensor goes straight into its target sharding: every device
receives only its own block, never the whole model.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from rkvjax.convert.errors import CheckpointError
from rkvjax.convert.hf_config import read_json_object
from rkvjax.models import sharding
from rkvjax.models.config import ModelConfig
from rkvjax.models.decoder import Decoder, abstract_decoder

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
}


class SafetensorsFile:
    """Lazy, zero-copy reader of one `.safetensors` file."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated ({size} bytes, too short for a safetensors file); "
                    "download or copy it again"
                )
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated (its header claims {n} bytes, the file has {size}); "
                    "download or copy it again"
                )
            header = _parse_header(path, f.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            _check_entry(path, name, info, size - 8 - n)
        self.header = header
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}"
            )
        start, end = info["data_offsets"]
        return self._data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def _parse_header(path: Path, raw: bytes) -> dict:
    """A safetensors header: a JSON object of tensor name -> {dtype, shape, data_offsets}."""
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: unreadable safetensors header (not a JSON object); the file is damaged or "
            "not safetensors: download or copy it again"
        )
    return header


def _check_entry(path: Path, name: str, info, data_bytes: int) -> None:
    """Checks that tensor `name`'s entry is well formed and its bytes lie inside the file, so a
    truncated file fails here, naming the tensor, not as a reshape error later."""
    try:
        start, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        dtype = info["dtype"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for tensor {name}") from None
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: truncated: tensor {name} needs bytes {start}..{end} of the data, the file "
            f"holds {data_bytes}; download or copy it again"
        )
    itemsize = np.dtype(_DTYPES[dtype]).itemsize if dtype in _DTYPES else None
    if not 0 <= start <= end or (itemsize and end - start != math.prod(shape) * itemsize):
        raise CheckpointError(
            f"{path}: tensor {name} has {end - start} bytes at offsets {start}..{end}, which do "
            f"not hold a {dtype} tensor of shape {tuple(shape)}; the file is damaged"
        )


def open_checkpoint(folder: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, from the index file or every `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        for name in sorted(set(weight_map.values())):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{index}: lists {name}, which is not in {folder}")
        files = {name: SafetensorsFile(folder / name) for name in sorted(set(weight_map.values()))}
        where = {t: files[name] for t, name in weight_map.items()}
        for name, sf in files.items():
            listed = {t for t, n in weight_map.items() if n == name}
            if listed != set(sf.keys()):
                raise CheckpointError(
                    f"{folder}: {name} does not hold what the index lists "
                    f"(e.g. {sorted(listed ^ set(sf.keys()))[:3]})"
                )
        return where
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    where: dict[str, SafetensorsFile] = {}
    for p in paths:
        sf = SafetensorsFile(p)
        for t in sf.header:
            if t in where:
                raise CheckpointError(f"{folder}: tensor {t} appears in two files")
            where[t] = sf
    return where


def _weight_map(index: Path) -> dict[str, str]:
    """The index file's tensor name -> file name map."""
    weight_map = read_json_object(index, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: no `weight_map` object of tensor name -> file name")
    return weight_map


# HF name -> (our state path, HF shape, transform into our layout, axis). Several HF tensors may
# fill one parameter: their transformed pieces are concatenated along `axis`, in table order
# (q, k and v along axis 1 of wqkv; a MoE layer's experts along axis 0 of its stacked weights).
class Rule(NamedTuple):
    path: tuple
    shape: tuple[int, ...]
    fn: Callable[[np.ndarray], np.ndarray]
    axis: int = 1


def expected_tensors(cfg: ModelConfig) -> dict[str, Rule]:
    """Every tensor a checkpoint of `cfg` must hold, by its Hugging Face name."""
    d, f, n, k, h, v = cfg.embed, cfg.ffw, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.vocab_size
    g = n // k

    def split(*shape):  # HF's flat (heads * head_dim) axis -> our separate heads axes
        return lambda w: w.reshape(shape)

    same = lambda w: w
    one = lambda w: w[None]  # an expert's weight, one slice of the stacked [E, ...] weight
    # q, k and v fill wqkv [K, G + 2, H, D]: KV head j holds query heads j * G ... j * G + G - 1
    # (HF's grouping), then its key and value heads.
    attention = {
        "input_layernorm.weight": Rule(("attn_norm",), (d,), same),
        "post_attention_layernorm.weight": Rule(("mlp_norm",), (d,), same),
        "self_attn.q_proj.weight": Rule(("attn", "wqkv"), (n * h, d), split(k, g, h, d)),
        "self_attn.k_proj.weight": Rule(("attn", "wqkv"), (k * h, d), split(k, 1, h, d)),
        "self_attn.v_proj.weight": Rule(("attn", "wqkv"), (k * h, d), split(k, 1, h, d)),
        "self_attn.o_proj.weight": Rule(("attn", "wo"), (d, n * h), split(d, n, h)),
    }
    if cfg.qkv_bias:
        attention["self_attn.q_proj.bias"] = Rule(("attn", "bqkv"), (n * h,), split(k, g, h))
        attention["self_attn.k_proj.bias"] = Rule(("attn", "bqkv"), (k * h,), split(k, 1, h))
        attention["self_attn.v_proj.bias"] = Rule(("attn", "bqkv"), (k * h,), split(k, 1, h))
    if cfg.o_bias:
        attention["self_attn.o_proj.bias"] = Rule(("attn", "bo"), (d,), same)
    if cfg.qk_norm:
        attention["self_attn.q_norm.weight"] = Rule(("attn", "q_norm"), (h,), same)
        attention["self_attn.k_norm.weight"] = Rule(("attn", "k_norm"), (h,), same)
    dense = {
        "mlp.gate_proj.weight": Rule(("mlp", "gate"), (f, d), same),
        "mlp.up_proj.weight": Rule(("mlp", "up"), (f, d), same),
        "mlp.down_proj.weight": Rule(("mlp", "down"), (d, f), same),
    }
    sparse = {}
    if cfg.experts is not None:
        fe = cfg.experts.ffw
        sparse["mlp.gate.weight"] = Rule(("mlp", "router"), (cfg.experts.count, d), same)
        for e in range(cfg.experts.count):
            for name, ours, shape in (("gate", "gate", (fe, d)), ("up", "up", (fe, d)),
                                      ("down", "down", (d, fe))):  # fmt: skip
                sparse[f"mlp.experts.{e}.{name}_proj.weight"] = Rule(("mlp", ours), shape, one, 0)
    rules: dict[str, Rule] = {
        "model.embed_tokens.weight": Rule(("embed",), (v, d), same),
        "model.norm.weight": Rule(("norm",), (d,), same),
    }
    if not cfg.tie_embeddings:
        rules["lm_head.weight"] = Rule(("lm_head",), (v, d), same)
    for i in range(cfg.num_layers):
        mlp = sparse if cfg.sparse(i) else dense
        for name, rule in {**attention, **mlp}.items():
            rules[f"model.layers.{i}.{name}"] = rule._replace(path=("layers", i, *rule.path))
    return rules


def _skippable(name: str, cfg: ModelConfig) -> bool:
    """Tensors some checkpoints carry that hold no weights of their own."""
    if cfg.tie_embeddings and name == "lm_head.weight":  # a saved copy of the tied embedding
        return True
    return re.fullmatch(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", name) is not None


def _place(arr: np.ndarray, dtype, axes: tuple[str, ...], mesh, rules) -> jax.Array:
    """A host tensor -> a device array, split over `mesh` by its logical `axes` if given."""
    if mesh is None:
        # Committed to the device a converted folder restores onto (checkpoint.restore): jit
        # caches its programs per committed-ness too, so the same weights read from either
        # source would otherwise compile every program twice in one process.
        return jax.device_put(jnp.asarray(arr, dtype=dtype), jax.local_devices()[0])
    # Each device receives its own index block, so no device holds the whole tensor.
    return sharding.host_array(np.asarray(arr, dtype=dtype), rules.named(mesh, *axes))


def load_weights(
    folder: str | Path,
    cfg: ModelConfig,
    dtype=jnp.float32,
    *,
    mesh=None,
    rules: sharding.ShardingRules | None = None,
) -> Decoder:
    """Reads a Hugging Face safetensors checkpoint into a Decoder with weights in `dtype`.

    With a `mesh`, each parameter is sharded by its logical axes (the `axes` metadata of its
    `nnx.Param`) through `rules` (default: `sharding.check_divisible(cfg, mesh)`).
    """
    if mesh is not None and rules is None:
        rules = sharding.check_divisible(cfg, mesh)
    folder = Path(folder)
    tensors = open_checkpoint(folder)
    table = expected_tensors(cfg)
    extra = sorted(t for t in tensors if t not in table and not _skippable(t, cfg))
    if extra:
        raise CheckpointError(
            f"{folder}: unexpected tensor(s) {extra[:5]} for a {cfg.arch} model as config.json "
            f"describes it ({len(extra)} in all)"
        )
    missing = [t for t in table if t not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    graphdef, spec = nnx.split(abstract_decoder(cfg, dtype))
    flat_spec = dict(nnx.to_flat_state(spec))
    values, pieces = {}, {}
    wanted = Counter(rule.path for rule in table.values())
    for name, (path, hf_shape, fn, axis) in table.items():
        raw = tensors[name].get(name)
        if tuple(raw.shape) != hf_shape:
            raise CheckpointError(
                f"{folder}: tensor {name} has shape {tuple(raw.shape)}, expected {hf_shape} "
                "from config.json"
            )
        pieces.setdefault(path, []).append(fn(np.asarray(raw)))  # stored dtype: cast once, below
        if len(pieces[path]) < wanted[path]:
            continue
        parts = pieces.pop(path)
        arr = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        axes = flat_spec[path].get_metadata()["axes"]
        values[path] = flat_spec[path].replace(_place(arr, dtype, axes, mesh, rules))
    if values.keys() != flat_spec.keys():  # the rule table and the model must agree exactly
        raise AssertionError(f"rule table out of sync: {sorted(values.keys() ^ flat_spec.keys())}")
    return nnx.merge(graphdef, nnx.from_flat_state(list(values.items())))


def hf_tensors(decoder: Decoder, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The decoder's weights as a Hugging Face checkpoint's tensors, by name: the inverse of
    `load_weights`, read off the same rule table (a parameter several tensors fill is cut
    along its rule's axis in table order), so that a model trained here saves as a folder that
    `rkvjax.load` and transformers read back unchanged."""
    flat = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(decoder))}
    offsets: dict[tuple, int] = {}
    out = {}
    for name, (path, hf_shape, fn, axis) in expected_tensors(cfg).items():
        arr = flat[path]
        width = fn(np.zeros(hf_shape, np.int8)).shape  # this tensor's piece in our layout
        if width != arr.shape:  # one of several pieces along the rule's axis
            at = offsets.get(path, 0)
            offsets[path] = at + width[axis]
            arr = np.take(arr, range(at, at + width[axis]), axis=axis)
        out[name] = np.ascontiguousarray(arr.reshape(hf_shape))
    return out
