"""Load time and peak host memory: a Hugging Face safetensors folder against the same weights
converted by `rkvjax convert` (Orbax).

Both formats store the dtype being loaded: for `--dtype bfloat16` the Hugging Face folder is
first rewritten in bfloat16 (as real checkpoints such as R1-Distill ship), so neither side casts.

Each load runs in a fresh process (no JAX state or allocator reuse carries over), alternating
formats, and reports medians. The child times `rkvjax.load` (config, weights and tokenizer) until
every weight is on device, and within it the format's own weight reader (`weights_s`); importing
JAX and Flax happens before, timed apart (`startup_s`). It reads the load's peak resident set
(VmHWM, reset just before the load, so it is the load's own peak; Linux only), then again once
every weight byte has been read: a memory-mapped weight only becomes resident when first used,
so the second figure is what the model holds when it runs. That first read is timed too
(`first_read_s`): mapped pages fault in then, not during the load. The files are
read once before timing, so both formats load from the OS page cache: this measures the loader,
not the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common

TINY = dict(repeats=1)
PREFER_MEMORY = False
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
import numpy as np
import rkvjax
from rkvjax.convert import checkpoint, hf_safetensors  # imports Flax: start-up, timed apart
def rss():  # this process's peak resident set since the last reset (Linux)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
weights_s = []
def timed_reader(read):  # the format's own weight reader, until every weight is on device
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        decoder = jax.block_until_ready(read(*args, **kwargs))
        weights_s.append(time.perf_counter() - t)
        return decoder
    return wrapper
checkpoint.restore = timed_reader(checkpoint.restore)
hf_safetensors.load_weights = timed_reader(hf_safetensors.load_weights)
path, dtype = sys.argv[1], sys.argv[2]
jax.devices()  # backend start-up is not part of a load
startup = time.perf_counter() - t0
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident set
before = rss()
t0 = time.perf_counter()
model = rkvjax.load(path, dtype=dtype)
jax.block_until_ready(model.decoder)
load_s, peak = time.perf_counter() - t0, rss()
t0 = time.perf_counter()
for x in jax.tree.leaves(model.decoder):  # reads every weight byte, as the first step will
    np.asarray(x).view(np.uint8).sum()
print(json.dumps({"load_s": load_s, "weights_s": weights_s[0], "startup_s": startup,
                  "first_read_s": time.perf_counter() - t0,
                  "rss_before": before, "rss_peak": peak, "rss_in_use": rss()}))
"""


def add_arguments(p) -> None:
    common.add_model_argument(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)


def _read_all(folder: Path) -> None:
    """Warms the page cache with every file under `folder`."""
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def safetensors_copy(folder: Path, out: Path, dtype: str) -> Path:
    """`folder` with its safetensors tensors cast to `dtype` (config and tokenizer files kept)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.astype(np_dtype) for k, v in load_file(f).items()}, out / f.name)
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _child(path: Path, dtype: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), dtype],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args, folder) -> list[dict]:
    from rkvjax.models import loading

    model, name = common.load_model(args, args.dtype)  # prepares a .gguf / the default
    hf_folder = model.path
    del model
    with tempfile.TemporaryDirectory() as tmp:
        orbax_folder = loading.convert(hf_folder, Path(tmp) / "converted", dtype=args.dtype)
        st_folder = safetensors_copy(hf_folder, Path(tmp) / "hf", args.dtype)
        formats = {"safetensors": st_folder, "orbax": orbax_folder}
        for f in formats.values():
            _read_all(f)
        runs = {fmt: [] for fmt in formats}
        for _ in range(args.repeats):
            for fmt, f in formats.items():
                runs[fmt].append(_child(f, args.dtype))
        sizes = {fmt: _folder_bytes(f) for fmt, f in formats.items()}
    meta = common.run_meta()
    rows = []
    for fmt, rs in runs.items():
        row = {
            "bench": "load_time",
            "model": name,
            "dtype": args.dtype,
            "format": fmt,
            "repeats": args.repeats,
            "load_s": statistics.median(r["load_s"] for r in rs),
            "load_s_runs": [r["load_s"] for r in rs],
            "weights_s": statistics.median(r["weights_s"] for r in rs),
            "first_read_s": statistics.median(r["first_read_s"] for r in rs),
            "startup_s": statistics.median(r["startup_s"] for r in rs),
            "peak_rss_bytes": statistics.median(r["rss_peak"] for r in rs),
            "rss_before_load_bytes": statistics.median(r["rss_before"] for r in rs),
            "folder_bytes": sizes[fmt],
            "load_avg_1m": os.getloadavg()[0],
            **meta,
        }
        row["peak_rss_added_bytes"] = row["peak_rss_bytes"] - row["rss_before_load_bytes"]
        row["rss_in_use_added_bytes"] = (
            statistics.median(r["rss_in_use"] for r in rs) - row["rss_before_load_bytes"]
        )
        common.emit(row, folder)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    head = (
        f"{base['model']} {base['dtype']}, medians of {base['repeats']} loads per format, each in "
        "a fresh process; x faster: against the first format; MiB: host memory added by the "
        "load, in use once every weight byte was read, and on disk."
    )
    mib = 2**-20
    columns = [
        ("format", "format", "s"),
        ("load s", "load_s", ".2f"),
        ("x faster", lambda r: base["load_s"] / r["load_s"], ".2f"),
        ("weights s", "weights_s", ".3f"),
        ("x faster", lambda r: base["weights_s"] / r["weights_s"], ".2f"),
        ("1st read s", "first_read_s", ".3f"),
        ("load MiB", lambda r: r["peak_rss_added_bytes"] * mib, ".0f"),
        ("in use MiB", lambda r: r["rss_in_use_added_bytes"] * mib, ".0f"),
        ("on disk MiB", lambda r: r["folder_bytes"] * mib, ".0f"),
    ]
    return f"{head}\n\n{common.markdown_table(rows, columns)}"


def plot(plt, rows: list[dict]):
    """Load time (with the weight read inside it) and host memory, per format."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
    labels = [r["format"] for r in rows]
    common.bars(
        ax1,
        labels,
        [r["load_s"] for r in rows],
        ylabel="load s",
        title=f"{rows[0]['model']} {rows[0]['dtype']}",
    )
    common.bars(
        ax2,
        labels,
        [r["rss_in_use_added_bytes"] * 2**-20 for r in rows],
        ylabel="host MiB in use after the first read",
        title="",
    )
    return fig
