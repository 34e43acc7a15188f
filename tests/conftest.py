"""Shared fixtures: CPU-only JAX, tiny random Hugging Face checkpoints, the default model."""

import os

# Before JAX initialises: CPU only, with 8 host devices for the sharding tests. The suite
# compiles hundreds of programs and runs each briefly; without LLVM's optimisation passes XLA
# compiles them about a quarter faster (a 25 s test_runtime case took 18 s), and the matrix
# products, which run as library calls, keep their speed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
# The command line keeps compiled programs on disk (`home.enable_compile_cache`); in tests that
# would write outside the test folders and switch the cache on for every later test.
os.environ.setdefault("RKVJAX_COMPILE_CACHE", "0")

import jax
import pytest
import torch

from tests import hf_tiny

# Float32 parity means float32 arithmetic. JAX computes float32 dots in TF32 on recent GPUs by
# default, which moved logprobs by 4e-4 and flipped near-tied greedy tokens on an H200.
jax.config.update("jax_default_matmul_precision", "highest")

# The reference models are tiny: one thread avoids oversubscribing the 2-core CI machine, where
# torch's thread pool contending with XLA's made them about 15x slower.
torch.set_num_threads(1)


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drops the compiled programs after a test once the process holds many memory mappings.
    XLA:CPU maps each kernel's code separately, about 1,300 mappings per engine configuration
    here, and the suite compiles enough configurations to pass the kernel's limit of 65,530
    mappings, where compilation fails and the worker crashes: tests/test_policies.py alone
    reached 65,484, so a check at the end of each module was too late. Below the threshold the
    programs stay cached, so later tests reuse what earlier ones compiled."""
    yield
    if _memory_mappings() > 30_000:
        jax.clear_caches()


@pytest.fixture(scope="session")
def shared_data():
    """../shared/data next to the checkout (MATH-500, AIME 2024, real configs); a test that
    takes it skips where it is absent (`tests/shared_data.py`)."""
    from tests import shared_data

    return shared_data.need()


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct) converted once per session into a temporary
    RKVJAX_HOME, so tests never touch the user's cache."""
    from rkvjax.convert.default_model import default_model_dir

    home = tmp_path_factory.getbasetemp() / "rkvjax_home"
    old = os.environ.get("RKVJAX_HOME")
    os.environ["RKVJAX_HOME"] = str(home)
    try:
        yield default_model_dir()
    finally:
        if old is None:
            os.environ.pop("RKVJAX_HOME", None)
        else:
            os.environ["RKVJAX_HOME"] = old


@pytest.fixture(scope="session")
def smol(smol_dir):
    """The default model loaded with rkvjax (float32)."""
    import rkvjax

    return rkvjax.load(smol_dir, dtype="float32")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """kind -> (folder, transformers model) for a tiny random checkpoint, built once per session."""
    made = {}

    def make(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            made[kind] = (folder, hf_tiny.build(kind, folder))
        return made[kind]

    return make


# `make test` runs the suite on two workers (pytest-xdist, `--dist loadfile`), each taking
# whole files in collection order. The slowest files go first so that neither worker is left
# with a long file once the other is done: a clean two-worker run on the 2-core CI machine took
# about 400 s in test_runtime, 300 s in test_serve (a server process of the default model),
# 210 s in test_bench (the benchmark smoke run) and test_policy,
# and 100-170 s in each of the next five; every other file under 80 s.
SLOWEST_FIRST = (
    "test_runtime.py",
    "test_serve.py",
    "test_batch_invariance.py",
    "test_batch_invariance_float.py",
    "test_bench.py",
    "test_policy.py",
    "test_policies.py",
    "test_stateful_policies.py",
    "test_triattention.py",
    "test_jobs.py",
    "test_experts.py",
    "test_sharding.py",
    "test_multihost.py",
    "test_evaluation.py",
)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test file. XLA:CPU maps each program's code
    into memory (several mappings apiece) for as long as it is cached; a worker that ran
    hundreds of files' programs passed the kernel's limit of 65,530 mappings and crashed
    compiling the next (a segfault or an abort, then a stalled pytest-xdist run)."""
    yield
    jax.clear_caches()


def _file_rank(item) -> int:
    name = item.path.name
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config, items):
    import jax

    items.sort(key=_file_rank)  # stable: tests keep their order within a file

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# The prompt lengths the tiny checkpoints' TriAttention statistics are calibrated on.
CALIBRATION_LENGTHS = (13, 40, 27)


@pytest.fixture(scope="module")
def stats_of(tiny_checkpoint, tmp_path_factory):
    """kind -> the path of its tiny checkpoint's TriAttention statistics (`rkvjax calibrate`'s
    file), calibrated once per test file."""
    made = {}

    def make(kind: str) -> str:
        if kind not in made:
            from rkvjax.entrypoints import calibration
            from rkvjax.kv.policies import triattention_stats
            from tests.test_policy import _load, _prompt

            model = _load(tiny_checkpoint(kind)[0])
            prompts = [_prompt(n, seed=900 + n) for n in CALIBRATION_LENGTHS]
            path = tmp_path_factory.mktemp("calibration") / f"{kind}.npz"
            triattention_stats.save(calibration.calibrate(model, prompts, source="test"), path)
            made[kind] = str(path)
        return made[kind]

    return make
