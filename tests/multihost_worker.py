"""One process of the 2-process test (tests/test_multihost.py): joins the run, loads the tiny
checkpoint over a mesh spanning both processes' devices, generates (FullKV and R-KV), scores,
round-trips the weights through an Orbax checkpoint, and (process 0) writes the results as JSON.

    python -m tests.multihost_worker COORDINATOR NUM_PROCESSES PROCESS_ID CHECKPOINT OUT.json
"""

import json
import sys
from pathlib import Path


def main(coordinator: str, num: str, pid: str, folder: str, out: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from rkvjax.models import sharding

    sharding.initialize_distributed(coordinator, int(num), int(pid))
    import rkvjax
    from tests.test_multihost import SCORE
    from tests.test_sharding import GEN, PROMPTS

    assert jax.process_count() == int(num) and len(jax.devices()) > len(jax.local_devices())
    mesh = sharding.make_mesh(data=2, model=len(jax.devices()) // 2)
    model = rkvjax.load(folder, dtype="float32", mesh=mesh)
    res = {"devices": len(jax.devices()), "local_devices": len(jax.local_devices())}
    # FullKV and R-KV; the other methods' sharded runs are checked on one process's mesh
    # (tests/test_sharding.py), where they cost a fraction of a two-process compile.
    for method in ("full", "rkv"):
        out_ = rkvjax.generate(model, PROMPTS, method=method, **GEN)
        res[method] = [r.token_ids for r in out_]
    res["score"] = rkvjax.score(model, PROMPTS[2], prompt_len=12, **SCORE).logprobs.tolist()
    logits = rkvjax.logits(model, PROMPTS[1])  # a global array: gather every process's rows
    res["logits"] = np.asarray(multihost_utils.process_allgather(logits, tiled=True)).tolist()
    # Orbax from both processes: each writes its own shards, then restores them.
    from rkvjax.convert import checkpoint

    saved = checkpoint.save(model.decoder, Path(folder), Path(out).parent / "ckpt", source=folder)
    restored = rkvjax.load(saved, mesh=mesh)
    res["restored_rkv"] = [
        r.token_ids for r in rkvjax.generate(restored, PROMPTS, method="rkv", **GEN)
    ]
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
