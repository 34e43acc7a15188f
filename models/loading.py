"""Loading a checkpoint: `Model` (config, weights, tokenizer, mesh) and `load`."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from rkvjax.convert import default_model
from rkvjax.convert.default_model import DEFAULT_MODEL
from rkvjax.models import sharding
from rkvjax.models.config import ModelConfig

from rkvjax.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded checkpoint: static config, weights (an NNX Decoder pytree) and tokenizer."""

    config: ModelConfig
    decoder: Any  # rkvjax.models.decoder.Decoder
    tokenizer: Tokenizer | None
    path: Path
    dtype: Any
    mesh: jax.sharding.Mesh | None = None  # ("data", "model") the weights are split over
    rules: sharding.ShardingRules | None = None  # how (set with mesh; vocab may be replicated)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else ()

    @property
    def device(self) -> jax.Device:
        """A device of this process that the weights live on (the first of the mesh's that
        this process addresses, or the one device; the default device for abstract weights,
        which a compile-only run lowers for). Several processes each get one of their own:
        another process's device answers no queries (its memory, say)."""
        if self.mesh is not None:
            here = jax.process_index()
            return next(d for d in self.mesh.devices.flat if d.process_index == here)
        for leaf in jax.tree.leaves(self.decoder):
            if isinstance(leaf, jax.Array):
                return next(iter(leaf.devices()))
        return jax.local_devices()[0]

    @property
    def data_shards(self) -> int:
        """How many ways batch rows are split (the mesh's "data" axis; 1 without a mesh)."""
        if self.mesh is None or self.rules.batch is None:
            return 1
        return self.mesh.shape[self.rules.batch]


def _default_dtype():
    # float32 on CPU (XLA's CPU bfloat16 matmuls are emulated), bfloat16 on accelerators.
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _resolve(path: str | Path | None) -> Path:
    """Where the Hugging Face folder of `path` lies, preparing it first if it must be converted."""
    if path is None or str(path) == DEFAULT_MODEL:
        return default_model.default_model_dir()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return default_model.prepared_gguf_dir(p)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{path}: no such model folder (give a Hugging Face checkpoint folder, a .gguf "
            f"file, or {DEFAULT_MODEL!r} for the default model)"
        )
    return p


def read_config(path: str | Path | None = None):
    """The `ModelConfig` of the checkpoint `load(path)` would load, from its config.json alone
    (no weights read): what a command checks its settings against before it loads a model."""
    from rkvjax.convert.hf_config import read_hf_config

    return read_hf_config(_resolve(path))


def as_dtype(dtype):
    """ "float32" / "bfloat16" or a jnp dtype -> the dtype; anything else is an error."""
    allowed = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if isinstance(dtype, str):
        if dtype not in allowed:
            raise ValueError(f"dtype must be one of {sorted(allowed)}, got {dtype!r}")
        return allowed[dtype]
    try:
        ok = jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return dtype


def _auto_axes(mesh: Mesh) -> Mesh:
    """The mesh with Auto axes.

    `jax.make_mesh` gives Explicit axes by default in current JAX, under which every array's
    sharding is part of its type and the model's unannotated gathers and products fail to
    type-check; the engine pins shardings itself (`sharding.constrain`, `shard_map`), which is
    what Auto axes are for. Same devices, same names: only the axis types change.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (rkvjax.models.sharding.make_mesh), got "
            f"{type(mesh).__name__}"
        )
    if tuple(mesh.axis_names) != sharding.MESH_AXES:
        raise ValueError(
            f"mesh axes must be {sharding.MESH_AXES}, got {tuple(mesh.axis_names)}; "
            "use rkvjax.models.sharding.make_mesh"
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def load(path: str | Path | None = None, *, dtype=None, mesh=None) -> Model:
    """Loads a checkpoint.

    Args:
      path: a Hugging Face folder (`config.json`, `*.safetensors`, tokenizer files), a folder
        written by `rkvjax convert` (Orbax weights, restored into any mesh), a `.gguf` file
        (converted once and cached), or None / "SmolLM2-135M-Instruct" for the default model.
      dtype: weight dtype, "float32" / "bfloat16" or a jnp dtype. Default: a converted
        folder's own dtype; otherwise float32 on CPU, bfloat16 on GPU/TPU.
      mesh: a `("data", "model")` mesh (`rkvjax.models.sharding.make_mesh`, or `jax.make_mesh` with
        those axis names: its axes are used as Auto axes) to split the weights over: KV heads
        with their query heads, MLP hidden and vocab on "model"; `generate` then splits batch
        rows over "data". Each tensor is placed straight into its shards.

    Returns:
      A Model.
    """
    from rkvjax.convert import checkpoint
    from rkvjax.convert.hf_config import read_hf_config
    from rkvjax.convert.hf_safetensors import load_weights

    if dtype is not None:
        dtype = as_dtype(dtype)
    if mesh is not None:
        mesh = _auto_axes(mesh)
    folder = _resolve(path)
    converted = checkpoint.is_converted(folder)
    if dtype is None:
        dtype = as_dtype(checkpoint.read_marker(folder)["dtype"]) if converted else _default_dtype()
    cfg = read_hf_config(folder)
    rules = None if mesh is None else sharding.check_divisible(cfg, mesh)
    read = checkpoint.restore if converted else load_weights
    decoder = read(folder, cfg, dtype, mesh=mesh, rules=rules)
    return Model(
        config=cfg,
        decoder=decoder,
        tokenizer=Tokenizer.from_dir(folder),
        path=folder,
        dtype=dtype,
        mesh=mesh,
        rules=rules,
    )


def abstract(config: str | Path | dict, *, dtype="bfloat16") -> Model:
    """A model of a checkpoint's shape without its weights: a config.json (its path, or the
    dict) and a dtype -> a Model whose weights are ShapeDtypeStructs. Nothing is allocated, so
    `Engine.memory_analysis` can size an 8B model's runtime on a laptop; it cannot generate.
    """
    import json

    from rkvjax.convert.hf_config import parse_hf_config
    from rkvjax.models.decoder import abstract_decoder

    where = "config"
    if not isinstance(config, dict):
        where = str(config)
        config = json.loads(Path(config).read_text())
    cfg = parse_hf_config(config, where)
    dtype = as_dtype(dtype)
    return Model(
        config=cfg,
        decoder=abstract_decoder(cfg, dtype),
        tokenizer=None,
        path=Path(where),
        dtype=dtype,
    )


def random_init(config: str | Path | dict, *, dtype="bfloat16", seed: int = 0) -> Model:
    """A model of a checkpoint's shape with random weights (normal, std 0.02; norms at one),
    made on the default device in one compiled call: benchmarks at a real model's shape and
    dtype with nothing to download or read. Its outputs mean nothing and it has no tokenizer,
    so prompts are token ids."""
    from flax import nnx
    from rkvjax.models.decoder import Decoder

    shape = abstract(config, dtype=dtype)
    graphdef, _ = nnx.split(shape.decoder)

    @jax.jit
    def init():
        return nnx.split(Decoder(shape.config, dtype=shape.dtype, rngs=nnx.Rngs(seed)))[1]

    return dataclasses.replace(shape, decoder=nnx.merge(graphdef, init()))


def _source_paths(src) -> list[Path]:
    """The files and folders `rkvjax.load(src)` reads or prepares, found without loading or
    converting anything."""
    if src is None or str(src) == DEFAULT_MODEL:
        paths = [default_model.default_cache_dir()]
        with contextlib.suppress(ImportError, OSError):  # the load reports a missing package
            paths.append(default_model.default_gguf_path())
        return paths
    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return [path, default_model.gguf_cache_dir(path)]
    return [path]


def convert(src, out: Path, *, dtype=None, mesh=None, overwrite: bool = False) -> Path:
    """`rkvjax convert`: loads `src` (anything `rkvjax.load` takes) and saves it to `out`.

    `out` is checked (`check_output`) before the model is loaded, so a refused output costs no
    load and the source is never touched.
    """
    from rkvjax.convert.checkpoint import check_output, is_converted, read_marker, save

    out = check_output(out, _source_paths(src), overwrite=overwrite)
    model = load(src, dtype=dtype, mesh=mesh)
    if is_converted(model.path):
        source = read_marker(model.path).get("source", str(model.path))
    else:
        source = str(src if src is not None else DEFAULT_MODEL)
    print(f"converting {source} -> {out}", file=sys.stderr, flush=True)
    return save(model.decoder, model.path, out, source=source, overwrite=overwrite)
