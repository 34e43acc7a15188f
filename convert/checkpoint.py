"""Converted checkpoints: the decoder's weights as an Orbax checkpoint, restorable into any mesh.

`rkvjax convert SRC DST` writes a folder that `rkvjax.load` reads like a Hugging Face one:

    DST/
      rkvjax_checkpoint.json   format, version, weight dtype, source
      config.json              the source's model config (read through the same allow-list)
      tokenizer.json, tokenizer_config.json, generation_config.json   as in the source
      weights/                 Orbax (tensorstore) checkpoint, one array per parameter

The weights are stored already converted: in the decoder's own layout ([in, heads, head_dim]
projections, llama.cpp's Q/K permute undone) and dtype, so a load is a restore with no host-side
transposes or dequantization. Restoring takes an abstract target whose leaves carry the mesh
sharding of each parameter, so every process reads only the blocks of its own devices and the
model is never gathered on one device or host, whatever mesh the checkpoint was written from.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from rkvjax.models.decoder import Decoder, abstract_decoder

from rkvjax import sharding
from rkvjax.config import ModelConfig

FORMAT = "rkvjax-orbax"
FORMAT_VERSION = 1
MARKER = "rkvjax_checkpoint.json"
WEIGHTS = "weights"
# Files copied from the source folder; config.json is required, the rest when present.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class CheckpointError(ValueError):
    """A converted checkpoint that is incomplete, from another format version, or mismatched."""


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def read_marker(folder: Path) -> dict:
    try:
        meta = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder / MARKER}: unreadable ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{folder}: checkpoint format {meta.get('format')!r} version {meta.get('version')!r}; "
            f"this rkvjax reads {FORMAT!r} version {FORMAT_VERSION}: convert the source again"
        )
    if not (folder / WEIGHTS).is_dir():
        raise CheckpointError(f"{folder}: no {WEIGHTS}/ folder (an interrupted conversion?)")
    return meta


def _key(path: tuple) -> str:
    """An NNX state path ('layers', 3, 'attn', 'wq') -> 'layers.3.attn.wq' (Orbax tree key)."""
    return ".".join(str(p) for p in path)


def _flat_params(decoder: Decoder) -> dict[str, jax.Array]:
    _, state = nnx.split(decoder)
    return {_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def save(
    decoder: Decoder,
    source_folder: Path,
    out: Path,
    *,
    source: str,
    overwrite: bool = False,
) -> Path:
    """Writes `decoder`'s weights and `source_folder`'s config and tokenizer files to `out`.

    The folder is assembled next to `out` and renamed into place at the end, so an interrupted
    conversion never leaves a folder that looks complete. On several processes every process
    calls this (Orbax writes each process's shards); process 0 writes the side files.

    Raises:
      FileExistsError: if `out` exists and `overwrite` is False.
    """
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    import orbax.checkpoint as ocp

    tmp = out.with_name(f".{out.name}.partial")
    primary = jax.process_index() == 0
    if primary and tmp.exists():
        shutil.rmtree(tmp)
    _sync("rkvjax-convert-start")
    params = _flat_params(decoder)
    with _checkpointer() as ckpt:
        ckpt.save(tmp / WEIGHTS, args=ocp.args.PyTreeSave(params))
    if primary:
        for name in _SIDE_FILES:
            if (source_folder / name).is_file():
                shutil.copy2(source_folder / name, tmp / name)
        dtype = jnp.dtype(next(iter(params.values())).dtype).name
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "source": source}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    _sync("rkvjax-convert-done")
    return out


def restore(
    folder: Path,
    cfg: ModelConfig,
    dtype,
    *,
    mesh=None,
    rules: sharding.ShardingRules | None = None,
) -> Decoder:
    """Restores a converted checkpoint into a Decoder with weights in `dtype`, each parameter
    placed by its logical axes on `mesh` (one device without a mesh).

    Raises:
      CheckpointError: if the stored parameters do not match the model `config.json` describes.
    """
    import orbax.checkpoint as ocp

    if mesh is not None and rules is None:
        rules = sharding.check_divisible(cfg, mesh)
    graphdef, spec = nnx.split(abstract_decoder(cfg, dtype))
    flat_spec = list(nnx.to_flat_state(spec))
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {}
    for path, var in flat_spec:
        axes = var.get_metadata()["axes"]
        where = one_device if mesh is None else rules.named(mesh, *axes)
        target[_key(path)] = jax.ShapeDtypeStruct(var.get_value().shape, dtype, sharding=where)
    with _checkpointer() as ckpt:
        _check_params(folder, _stored_shapes(ckpt.metadata(folder / WEIGHTS)), target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        values = ckpt.restore(
            folder / WEIGHTS, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        )
    leaves = [(path, var.replace(values[_key(path)])) for path, var in flat_spec]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def _checkpointer():
    """A synchronous Orbax checkpointer. Weights are stored as uncompressed zarr3 arrays in one
    OCDBT database: float weights barely compress (zstd saved little on the default model), and
    decompression made restores slower."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))


def _stored_shapes(metadata) -> dict[str, tuple[int, ...]]:
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    return {k: tuple(v.shape) for k, v in dict(tree).items()}


def _check_params(folder: Path, stored: dict, target: dict) -> None:
    missing = sorted(target.keys() - stored.keys())
    extra = sorted(stored.keys() - target.keys())
    if missing or extra:
        raise CheckpointError(
            f"{folder}: the stored weights do not match config.json: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for k, t in target.items():
        if stored[k] != t.shape:
            raise CheckpointError(
                f"{folder}: parameter {k} is stored with shape {stored[k]}, config.json "
                f"implies {t.shape}"
            )


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def convert(src, out: Path, *, dtype=None, mesh=None, overwrite: bool = False) -> Path:
    """`rkvjax convert`: loads `src` (anything `rkvjax.load` takes) and saves it to `out`."""
    from rkvjax import api

    model = api.load(src, dtype=dtype, mesh=mesh)
    if is_converted(model.path):
        source = read_marker(model.path).get("source", str(model.path))
    else:
        source = str(src if src is not None else api.DEFAULT_MODEL)
    print(f"converting {source} -> {out}", file=sys.stderr, flush=True)
    return save(model.decoder, model.path, out, source=source, overwrite=overwrite)
