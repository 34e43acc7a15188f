"""Converted checkpoints: the decoder's weights as an Orbax checkpoint, restorable into any mesh.

`rkvjax convert SRC DST` writes a folder that `rkvjax.load` reads like a Hugging Face one:

    DST/
      rkvjax_checkpoint.json   format, version, weight dtype, source
      config.json              the source's model config (read through the same allow-list)
      tokenizer.json, tokenizer_config.json, generation_config.json   as in the source
      weights/                 Orbax (tensorstore) checkpoint, one array per parameter

The weights are stored already converted: in the decoder's own layout ([out, in] projections
split by heads, llama.cpp's Q/K permute undone) and dtype, so a load is a read with no host-side
transposes or dequantization. Each process reads only the blocks of its own devices' shards of
the target mesh, so the model is never gathered on one device or host, whatever mesh the
checkpoint was written from.

Orbax writes the checkpoint; `restore` reads its arrays with tensorstore, the library Orbax
itself reads them with, issuing every shard's read at once. Orbax's own restore took 1.25 s of
a 1.9 s load of the default model, mostly per-array asyncio and metadata work for 272 small
arrays; the direct reads take about 0.3 s (`bench/README.md`). `test_checkpoint` checks that
both readers agree.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rkvjax.models.decoder import Decoder, abstract_decoder

from rkvjax import sharding
from rkvjax.config import ModelConfig

FORMAT = "rkvjax-orbax"
FORMAT_VERSION = 2  # 2: weights stored [out, in] (features-major decoder)
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
    read_marker(folder)  # the format version, whatever dtype the caller asked for
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
    values = read_params(folder, target)
    leaves = [(path, var.replace(values[_key(path)])) for path, var in flat_spec]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def read_params(folder: Path, target: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The stored parameters named by `target`, as arrays with its shapes, dtypes and shardings.

    Every distinct shard this process's devices hold is read once, all reads in flight together,
    memory-mapped, into 64-byte-aligned host buffers (cast on the way when `target` asks for
    another dtype): `jax.device_put` adopts such buffers on CPU without a copy.

    Raises:
      CheckpointError: if the stored names or shapes differ from `target`'s.
    """
    import tensorstore as ts

    _check_params(folder, _stored_names(folder), target)
    base = f"file://{(folder / WEIGHTS).resolve()}"
    context = ts.Context({"file_io_mode": {"mode": "memmap"}})  # shared: one OCDBT manifest
    opening = {
        k: ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": k}},
            context=context,
        )
        for k in target
    }
    stored = {k: f.result() for k, f in opening.items()}
    _check_shapes(folder, {k: tuple(a.shape) for k, a in stored.items()}, target)
    placements = {k: t.sharding.addressable_devices_indices_map(t.shape) for k, t in target.items()}
    sources = {}  # (name, shard index) -> stored block, cast to the target dtype
    for k, t in target.items():
        dtype = ts.dtype(jnp.dtype(t.dtype).name)
        for index in placements[k].values():
            src = stored[k][index].translate_to[0]
            sources.setdefault(
                (k, _index_key(index)), src if src.dtype == dtype else ts.cast(src, dtype)
            )
    arena = _Arena(sum(_padded(s.shape, target[k].dtype) for (k, _), s in sources.items()))
    blocks, writes = {}, []
    for (k, i), src in sources.items():
        blocks[k, i] = arena.take(src.shape, target[k].dtype)
        writes.append(ts.array(blocks[k, i], copy=False, write=True).write(src))
    for w in writes:
        w.result()
    out = {}
    for k, t in target.items():
        placed = placements[k]
        shards = jax.device_put([blocks[k, _index_key(i)] for i in placed.values()], list(placed))
        out[k] = jax.make_array_from_single_device_arrays(t.shape, t.sharding, shards)
    return out


_ALIGN = 64  # XLA:CPU adopts host buffers aligned to this without a copy


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _padded(shape: tuple[int, ...], dtype) -> int:
    return -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN


class _Arena:
    """One host allocation carved into 64-byte-aligned arrays.

    An anonymous mapping without huge-page advice: its pages fault in on the copy threads that
    fill them, in parallel. NumPy's own large allocations ask for huge pages, which made filling
    0.5 GB take anywhere from 0.13 to 1.2 s here (the kernel compacts memory on such faults).
    """

    def __init__(self, nbytes: int):
        import mmap

        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._raw = np.frombuffer(mapping, np.uint8)
        self._at = 0  # mappings start on a page boundary

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        out = self._raw[self._at : self._at + _nbytes(shape, dtype)].view(dtype).reshape(shape)
        self._at += _padded(shape, dtype)
        return out


def _index_key(index: tuple) -> tuple:
    """A shard index (a tuple of slices) as a hashable key: slices are not before Python 3.12."""
    return tuple((s.start, s.stop, s.step) for s in index)


def _checkpointer():
    """A synchronous Orbax checkpointer. Weights are stored as uncompressed zarr3 arrays in one
    OCDBT database: float weights barely compress (zstd saved little on the default model), and
    decompression made restores slower."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))


def _stored_names(folder: Path) -> set[str]:
    """Parameter names in the checkpoint's tree metadata (Orbax's `_METADATA`)."""
    try:
        tree = json.loads((folder / WEIGHTS / "_METADATA").read_text(encoding="utf-8"))
        return {v["key_metadata"][0]["key"] for v in tree["tree_metadata"].values()}
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{folder}: unreadable weight metadata ({e!r})") from None


def _check_params(folder: Path, stored: set[str], target: dict) -> None:
    missing = sorted(target.keys() - stored)
    extra = sorted(stored - target.keys())
    if missing or extra:
        raise CheckpointError(
            f"{folder}: the stored weights do not match config.json: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )


def _check_shapes(folder: Path, stored: dict[str, tuple[int, ...]], target: dict) -> None:
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
