"""Two processes on localhost joined by `jax.distributed` (CPU gloo collectives) produce the
same tokens, scores and logits as one process, and save and restore an Orbax checkpoint."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import rkvjax
from rkvjax import sharding
from tests import hf_tiny
from tests.test_sharding import GEN, PROMPTS
from tests.tolerances import SELF_ATOL

SCORE = dict(method="rkv", budget=10, buffer=4)
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Workers:
    """The two processes of `tests.multihost_worker`, joined over localhost, each with two CPU
    devices (a data=2 x model=2 mesh spans both). Started when the session's tests are
    collected (tests/conftest.py): their minute of compilation then overlaps other tests
    instead of holding the session while it waits."""

    def __init__(self):
        folder = hf_tiny.cached("llama")[0]  # the `tiny_checkpoint` fixture's, same process
        self.dir = Path(tempfile.mkdtemp(prefix="rkvjax-multihost-"))
        self.out = self.dir / "result.json"
        coordinator = f"localhost:{_free_port()}"
        # Not this process's 8 host devices; its faster-compiling optimisation level, though.
        flags = "--xla_backend_optimization_level=0"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "2"}
        self.logs = [(self.dir / f"process{i}.log").open("w") for i in range(2)]
        # Files, not pipes: nothing reads a pipe until the tests ask, and a full one stalls.
        worker = [sys.executable, "-m", "tests.multihost_worker", coordinator, "2"]
        self.procs = [
            subprocess.Popen(
                [*worker, str(i), str(folder), str(self.out)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i, log in enumerate(self.logs)
        ]

    def result(self, timeout: float) -> dict:
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        finally:
            self.stop()
        for i, p in enumerate(self.procs):
            log = (self.dir / f"process{i}.log").read_text()
            assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


_workers: Workers | None = None


def _started() -> Workers:
    global _workers
    if _workers is None:
        _workers = Workers()
    return _workers


def start_background(items) -> None:
    """Called by tests/conftest.py once the session's tests are collected."""
    if any("two_processes" in i.fixturenames for i in items):
        _started()


def stop_background() -> None:
    if _workers is not None:
        _workers.stop()
        shutil.rmtree(_workers.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_processes():
    return _started().result(timeout=300)


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
