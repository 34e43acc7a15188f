"""Two processes on localhost joined by `jax.distributed` (CPU gloo collectives) produce the
same tokens, scores and logits as one process, and save and restore an Orbax checkpoint."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.models import sharding

import rkvjax
from tests.limits import HANG_S
from tests.test_sharding import GEN, PROMPTS
from tests.tolerances import SELF_ATOL

SCORE = dict(method="rkv", budget=10, buffer=4)
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tiny_checkpoint, tmp_path_factory) -> dict:
    """What the two processes of `tests.multihost_worker` computed, joined over localhost,
    each with two CPU devices (a data=2 x model=2 mesh spans both)."""
    folder = tiny_checkpoint("llama")[0]
    out = tmp_path_factory.mktemp("multihost")
    coordinator = f"localhost:{_free_port()}"
    # Not this process's 8 host devices; its faster-compiling optimisation level, though.
    flags = "--xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "2"}
    worker = [sys.executable, "-m", "tests.multihost_worker", coordinator, "2"]
    logs = [out / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            # A file, not a pipe: nothing reads a pipe while the other process runs.
            with log.open("w") as f:
                procs.append(
                    subprocess.Popen(
                        [*worker, str(i), str(folder), str(out / "result.json")],
                        cwd=ROOT,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        for p in procs:
            p.wait(timeout=HANG_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i].read_text()[-4000:]}"
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def single(tiny_checkpoint):
    return rkvjax.load(tiny_checkpoint("llama")[0], dtype="float32")


def test_runs_on_both_processes_devices(two_processes):
    assert two_processes["devices"] == 4 and two_processes["local_devices"] == 2


@pytest.mark.parametrize("method", ["full", "rkv"])
def test_generate_matches_one_process(two_processes, single, method):
    want = [r.token_ids for r in rkvjax.generate(single, PROMPTS, method=method, **GEN)]
    assert two_processes[method] == want


def test_orbax_round_trip_across_processes(two_processes, single):
    want = [r.token_ids for r in rkvjax.generate(single, PROMPTS, method="rkv", **GEN)]
    assert two_processes["restored_rkv"] == want


def test_score_and_logits_match_one_process(two_processes, single):
    want = rkvjax.score(single, PROMPTS[2], prompt_len=12, **SCORE).logprobs
    np.testing.assert_allclose(two_processes["score"], want, atol=SELF_ATOL[jnp.float32], rtol=0)
    logits = np.asarray(rkvjax.logits(single, PROMPTS[1]))
    np.testing.assert_allclose(two_processes["logits"], logits, atol=SELF_ATOL[jnp.float32], rtol=0)


@pytest.mark.parametrize(
    "args, match",
    [
        (("localhost:1234", 2, None), "needs all of"),
        ((None, 2, 0), "needs all of"),
        (("localhost:1234", 2, 2), r"process_id must be in \[0, 2\)"),
        (("localhost", 2, 0), "host:port"),
        ((":1234", 2, 0), "host:port"),
    ],
)
def test_initialize_distributed_errors(args, match):
    with pytest.raises(ValueError, match=match):
        sharding.initialize_distributed(*args)
    sharding.initialize_distributed()  # one process: nothing to do
