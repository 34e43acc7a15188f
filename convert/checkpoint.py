"""Converted checkpoints: the decoder's weights as an Orbax checkpoint, restorable into any mesh.

`rkvjax convert SRC DST` writes a folder that `rkvjax.load` reads like a Hugging Face one:

    DST/
      rkvjax_checkpoint.json   format, version, weight dtype, source
      config.json              the source's model config (read through the same allow-list)
      tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
      chat_templates/, generation_config.json   as in the source, when it has them
      weights/                 Orbax (tensorstore) checkpoint, one array per parameter

The weights are stored already converted: in the decoder's own layout ([out, in] projections
split by heads, llama.cpp's Q/K permute undone) and dtype, so a load is a read with no host-side
transposes or dequantization. Each process reads only the blocks of its own devices' shards of
the target mesh, so the model is never gathered on one device or host, whatever mesh the
checkpoint was written from.

Orbax writes the checkpoint, one uncompressed zarr3 array per parameter, without OCDBT: a file
per parameter and shard (a large model converted on a large mesh makes many files). `restore`
reads it without Orbax's restore, which spent 1.25 s of a 1.9 s load of the default model on
per-array asyncio and metadata work for 272 small arrays. A block a device needs that is exactly
one stored chunk in the dtype asked for (every weight, for a folder converted and loaded on one
device, or converted and loaded on the same mesh) is memory-mapped from its chunk file,
page-aligned, so a CPU device adopts the page cache's pages without a copy (no tensor of the
default model's safetensors file starts on the 64-byte boundary this needs, so that reader
copies). Any other block (another mesh's shards, a cast) is read with tensorstore, the library
Orbax itself reads with, all reads in flight together. `bench/README.md` has the numbers;
`test_checkpoint` checks both readers against Orbax's restore.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rkvjax.convert.errors import CheckpointError
from rkvjax.models import sharding
from rkvjax.models.config import ModelConfig
from rkvjax.models.decoder import Decoder, abstract_decoder

from rkvjax.text.tokenizer import CHAT_TEMPLATE_DIR, TOKENIZER_FILES

FORMAT = "rkvjax-orbax"
FORMAT_VERSION = 4  # 2: weights [out, in]; 3: a zarr3 folder per array, no OCDBT; 4: fused wqkv
MARKER = "rkvjax_checkpoint.json"
WEIGHTS = "weights"
# Copied from the source folder when present (config.json always is): everything the tokenizer
# reads, so a converted model renders chats and stops exactly as its source, and the legacy
# processor template file, which transformers still reads for multimodal models.
_SIDE_FILES = (*TOKENIZER_FILES, "chat_template.json")
_SIDE_DIRS = (CHAT_TEMPLATE_DIR,)


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
    """An NNX state path ('layers', 3, 'attn', 'wo') -> 'layers.3.attn.wo' (Orbax tree key)."""
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
      FileExistsError, CheckpointError: see `check_output`.
    """
    out = check_output(out, [source_folder], overwrite=overwrite)
    import orbax.checkpoint as ocp

    tmp = out.with_name(f".{out.name}.partial")
    primary = jax.process_index() == 0
    if primary and tmp.exists():
        shutil.rmtree(tmp)
    _sync("rkvjax-convert-start")
    params = _flat_params(decoder)
    with _checkpointer() as ckpt, _quiet_ocdbt_merge():
        ckpt.save(tmp / WEIGHTS, args=ocp.args.PyTreeSave(params))
    if primary:
        _copy_side_files(Path(source_folder), tmp)
        dtype = jnp.dtype(next(iter(params.values())).dtype).name
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype, "source": source}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    _sync("rkvjax-convert-done")
    return out


def _copy_side_files(source_folder: Path, dst: Path) -> None:
    """Copies the source's config, tokenizer and chat-template files that exist into `dst`."""
    for name in _SIDE_FILES:
        if (source_folder / name).is_file():
            shutil.copy2(source_folder / name, dst / name)
    for name in _SIDE_DIRS:
        if (source_folder / name).is_dir():
            shutil.copytree(source_folder / name, dst / name)


def check_output(out, sources, *, overwrite: bool) -> Path:
    """`out` made absolute, once it is sure that writing it deletes nothing but an earlier
    conversion: `--overwrite` replaces only a converted checkpoint (it has MARKER) or an empty
    folder, never a folder it did not write, and never one holding the source.

    Raises:
      CheckpointError: if `out` is, contains or lies inside one of `sources`.
      FileExistsError: if `out` exists and `overwrite` is False, or is something else than a
        converted checkpoint or an empty folder.
    """
    out = Path(out).expanduser().resolve()
    for src in sources:
        src = Path(src).expanduser().resolve()
        if src.is_relative_to(out):
            what = "is the source" if src == out else f"contains the source {src}"
            raise CheckpointError(f"output {out} {what}; choose another output folder")
        if out.is_relative_to(src):
            raise CheckpointError(
                f"output {out} lies inside the source {src}; choose a folder outside it"
            )
    if not out.exists():
        return out
    if not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    if not (out.is_dir() and (is_converted(out) or not any(out.iterdir()))):
        raise FileExistsError(
            f"{out} exists and is not a folder written by `rkvjax convert` (no {MARKER}); "
            "--overwrite replaces only those and empty folders: choose another output folder"
        )
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

    Every distinct block this process's devices hold is read once. A block that is one whole
    stored chunk in the target dtype is memory-mapped from its file (no copy: `jax.device_put`
    adopts page-aligned host memory on CPU). The others are read with tensorstore, all in flight
    together, into 64-byte-aligned host buffers, cast on the way when `target` asks for another
    dtype.

    Raises:
      CheckpointError: if the stored names or shapes differ from `target`'s.
    """
    _check_params(folder, _stored_names(folder), target)
    weights = (folder / WEIGHTS).resolve()
    meta = {k: _zarr_metadata(folder, k) for k in target}
    _check_shapes(folder, {k: m["shape"] for k, m in meta.items()}, target)
    placements = {k: t.sharding.addressable_devices_indices_map(t.shape) for k, t in target.items()}
    blocks, unmapped = {}, {}  # (name, block index) -> host array | the block's index
    budget = _mapping_budget()
    for k, t in target.items():
        chunk = _mappable_chunk_shape(meta[k], t.dtype)
        for index in placements[k].values():
            key = (k, _index_key(index))
            if key in blocks or key in unmapped:
                continue
            mapped = None
            if chunk is not None and len(blocks) < budget:
                mapped = _mapped_chunk(weights / k, chunk, index, t)
            if mapped is None:
                unmapped[key] = index
            else:
                blocks[key] = mapped
    if unmapped:
        blocks.update(_read_blocks(weights, unmapped, target))
    names, devices = [], []
    for k in target:
        names += [(k, _index_key(i)) for i in placements[k].values()]
        devices += list(placements[k])
    shards = iter(jax.device_put([blocks[n] for n in names], devices))  # one batched transfer
    return {
        k: jax.make_array_from_single_device_arrays(
            t.shape, t.sharding, [next(shards) for _ in placements[k]]
        )
        for k, t in target.items()
    }


def _read_blocks(
    weights: Path, blocks: dict[tuple, tuple], target: dict
) -> dict[tuple, np.ndarray]:
    """Reads each (name, block index) -> index of `blocks` with tensorstore, all reads in
    flight together, into one host arena, cast to the target dtype on the way."""
    import tensorstore as ts

    context = ts.Context({"file_io_mode": {"mode": "memmap"}})
    names = sorted({k for k, _ in blocks})
    opening = {
        k: ts.open({"driver": "zarr3", "kvstore": f"file://{weights}/{k}/"}, context=context)
        for k in names
    }
    stored = {k: f.result() for k, f in opening.items()}
    sources = {}
    for (k, i), index in blocks.items():
        src = stored[k][index].translate_to[0]
        dtype = ts.dtype(jnp.dtype(target[k].dtype).name)
        sources[k, i] = src if src.dtype == dtype else ts.cast(src, dtype)
    arena = _Arena(sum(_padded(s.shape, target[k].dtype) for (k, _), s in sources.items()))
    out, writes = {}, []
    for (k, i), src in sources.items():
        out[k, i] = arena.take(src.shape, target[k].dtype)
        writes.append(ts.array(out[k, i], copy=False, write=True).write(src))
    for w in writes:
        w.result()
    return out


# A zarr3 array whose chunks are shards of one inner chunk each, stored as raw little-endian
# bytes followed by the shard index (offset, length) and its checksum: what Orbax writes
# uncompressed. The chunk's bytes are then the array block itself.
_INDEX_CODECS = [
    {"name": "bytes", "configuration": {"endian": "little"}},
    {"name": "crc32c"},
]
_RAW = [{"name": "bytes", "configuration": {"endian": "little"}}]
# offset, length (uint64 each), crc32c (uint32). The checksum is not verified: a damaged index
# shows up as an offset or length that does not fit, and then tensorstore, which checks it, reads.
_INDEX_BYTES = 8 + 8 + 4
_MISSING = 2**64 - 1  # the index's marker for a chunk never written (all fill value)


def _zarr_metadata(folder: Path, name: str) -> dict:
    """Parameter `name`'s zarr3 array metadata (its `zarr.json`)."""
    path = folder / WEIGHTS / name / "zarr.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        meta["shape"] = tuple(meta["shape"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{folder}: unreadable metadata of parameter {name} ({e!r})"
        ) from None
    return meta


def _mappable_chunk_shape(meta: dict, dtype) -> tuple[int, ...] | None:
    """The chunk shape when the array `meta` describes stores its chunks as raw `dtype` blocks
    that can be mapped, else None (tensorstore reads any other layout)."""
    try:
        grid = meta["chunk_grid"]
        chunk = grid["configuration"]["chunk_shape"]
        encoding = meta["chunk_key_encoding"]
        (codec,) = meta["codecs"]
        config = codec["configuration"]
    except (KeyError, TypeError, ValueError):
        return None
    if (
        sys.byteorder != "little"
        or meta.get("data_type") != jnp.dtype(dtype).name
        or grid.get("name") != "regular"
        or encoding.get("name") != "default"
        or encoding.get("configuration", {}).get("separator", "/") != "/"
        or codec.get("name") != "sharding_indexed"
        or config.get("chunk_shape") != chunk
        or config.get("codecs") != _RAW
        or config.get("index_codecs") != _INDEX_CODECS
        or config.get("index_location", "end") != "end"
    ):
        return None
    return tuple(chunk)


def _mapping_budget() -> int:
    """How many chunk files one load may keep mapped. Before Python 3.13 (`trackfd=False`) each
    mapping holds a file descriptor for as long as the weight lives, so they may take a quarter
    of the process's limit; the rest of the blocks are read."""
    if sys.version_info >= (3, 13):
        return sys.maxsize
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft // 4


def _mapped_chunk(array: Path, chunk, index, target) -> np.ndarray | None:
    """Block `index` of `target`, stored in folder `array`, memory-mapped from its chunk file
    when that block is exactly one written chunk; None otherwise.

    The mapping is private (copy-on-write), so the buffer is writable like any other host array
    and nothing written to it reaches the file. Pages not yet read still come from the file: a
    converted folder must be replaced (as `rkvjax convert --overwrite` does, by renaming), never
    rewritten in place, while a model loaded from it is alive."""
    bounds = [i.indices(n)[:2] for i, n in zip(index, target.shape, strict=True)]
    if any(stop - start != c or start % c for (start, stop), c in zip(bounds, chunk, strict=True)):
        return None
    coords = (str(start // c) for (start, _), c in zip(bounds, chunk, strict=True))
    try:
        with open(array.joinpath("c", *coords), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            tail = os.pread(f.fileno(), 16, size - _INDEX_BYTES)
            offset, length = struct.unpack("<QQ", tail)
            if (
                offset == _MISSING
                or length != _nbytes(chunk, target.dtype)
                or offset + length > size - _INDEX_BYTES
            ):
                return None
            kwargs = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY, **kwargs)
    except (OSError, ValueError, struct.error):  # never written (all fill value), or truncated
        return None
    return np.frombuffer(mapping, target.dtype, math.prod(chunk), offset).reshape(chunk)


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
    """A synchronous Orbax checkpointer writing each weight as an uncompressed zarr3 array in its
    own folder. Float weights barely compress (zstd saved little on the default model) and
    decompressing slowed restores. Without OCDBT's shared data files, each chunk's bytes sit at a
    known place in a file of their own, which `_mapped_chunk` maps without a copy."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True, use_compression=False)
    return ocp.Checkpointer(handler)


@contextlib.contextmanager
def _quiet_ocdbt_merge():
    """Drops Orbax's warning that a save found no OCDBT files to merge: this format has none.
    Matched on its text: should Orbax reword it, the warning shows again, nothing worse."""

    def keep(record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT" not in record.getMessage()

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


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
