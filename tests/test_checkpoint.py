"""`rkvjax convert`: Orbax checkpoints of converted weights, restored into any mesh."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.convert import checkpoint

import rkvjax
from rkvjax import cli
from tests.test_sharding import GEN, PROMPTS, sub_mesh


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """Written from a data=4, model=2 mesh: every parameter saved as shards."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return checkpoint.convert(source, out, dtype="float32", mesh=sub_mesh(4, 2))


def _params(model):
    return {k: np.asarray(v) for k, v in checkpoint._flat_params(model.decoder).items()}


def test_layout(converted, source):
    meta = json.loads((converted / checkpoint.MARKER).read_text())
    assert meta["format"] == checkpoint.FORMAT and meta["dtype"] == "float32"
    assert meta["source"] == str(source)
    for name in ("config.json", "generation_config.json"):  # the tiny model has no tokenizer
        assert (converted / name).read_bytes() == (source / name).read_bytes()
    assert not any(converted.parent.glob(".*partial"))  # the temporary folder was renamed


@pytest.mark.parametrize("shape", [None, (1, 2), (2, 1), (8, 1)])
def test_restore_into_other_meshes(converted, source, shape):
    mesh = None if shape is None else sub_mesh(*shape)
    want = rkvjax.load(source, dtype="float32", mesh=mesh)
    got = rkvjax.load(converted, mesh=mesh)
    assert got.dtype == jnp.float32
    a, b = _params(got), _params(want)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    if mesh is not None:  # each parameter arrives in the sharding its logical axes give it
        for (path, x), (_, y) in zip(
            jax.tree_util.tree_leaves_with_path(got.decoder),
            jax.tree_util.tree_leaves_with_path(want.decoder),
            strict=True,
        ):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), path
    np.testing.assert_array_equal(
        np.asarray(rkvjax.logits(got, PROMPTS[2])), np.asarray(rkvjax.logits(want, PROMPTS[2]))
    )


def _mapped_file(a: np.ndarray) -> str | None:
    """The file whose memory mapping holds `a`'s first byte (Linux), None for anonymous memory."""
    at = a.ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= at < hi:
                return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


@pytest.mark.skipif(
    jax.default_backend() != "cpu" or not Path("/proc/self/maps").exists(),
    reason="checks CPU device buffers against Linux's memory map",
)
def test_whole_chunks_are_mapped_not_copied(source, tmp_path):
    """Loaded on one CPU device, every parameter is one stored chunk, and its device buffer must
    be that chunk file's pages (the load's speed and host memory rest on it). A cast cannot be:
    it is read, and must be anonymous memory."""
    out = checkpoint.convert(source, tmp_path / "one", dtype="float32")
    weights = (out / checkpoint.WEIGHTS).resolve()
    for k, v in checkpoint._flat_params(rkvjax.load(out).decoder).items():
        f = _mapped_file(np.asarray(v))
        assert f is not None and Path(f).is_relative_to(weights / k), (k, f)
    for k, v in checkpoint._flat_params(rkvjax.load(out, dtype="bfloat16").decoder).items():
        assert _mapped_file(np.asarray(v)) is None, k


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # Orbax's restore, as wanted
def test_reader_agrees_with_orbax(converted):
    """`read_params` reads Orbax's on-disk layout itself: whole chunks memory-mapped (here the
    replicated norms, stored as one chunk), the rest with tensorstore (the other weights, stored
    as a 4 x 2 mesh's shards, and every cast). It must equal Orbax's own restore, so a layout
    change in Orbax fails here."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as ckpt:
        stored = ckpt.restore(converted / checkpoint.WEIGHTS)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for dtype in (jnp.float32, jnp.bfloat16):
        target = {k: jax.ShapeDtypeStruct(v.shape, dtype, sharding=one) for k, v in stored.items()}
        got = checkpoint.read_params(converted, target)
        assert got.keys() == stored.keys()
        for k, v in stored.items():
            assert got[k].dtype == dtype
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v).astype(dtype), k)


def test_generate_from_converted(converted, source):
    got = rkvjax.generate(rkvjax.load(converted), PROMPTS, method="rkv", **GEN)
    want = rkvjax.generate(rkvjax.load(source, dtype="float32"), PROMPTS, method="rkv", **GEN)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_cli_convert_bfloat16(source, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert cli.main(["convert", str(source), str(out), "--dtype", "bfloat16"]) == 0
    assert "wrote" in capsys.readouterr().err
    model = rkvjax.load(out)  # the converted dtype is the default
    assert model.dtype == jnp.bfloat16
    want = rkvjax.load(source, dtype="bfloat16")
    for k, v in _params(model).items():
        np.testing.assert_array_equal(v, _params(want)[k], err_msg=k)
    as_f32 = rkvjax.load(out, dtype="float32")  # restore casts
    assert as_f32.decoder.embed[...].dtype == jnp.float32
    # Existing output: refused without --overwrite, replaced with it.
    assert cli.main(["convert", str(source), str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["convert", str(source), str(out), "--overwrite"]) == 0
    assert rkvjax.load(out).dtype == jnp.float32  # the CPU default, this time


def test_errors(converted, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing \['layers\.2\."):
        rkvjax.load(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(checkpoint.CheckpointError, match=r"mlp\.(down|gate|up) is stored"):
        rkvjax.load(bad)
    meta = json.loads((bad / checkpoint.MARKER).read_text())
    (bad / checkpoint.MARKER).write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(checkpoint.CheckpointError, match="convert the source again"):
        rkvjax.load(bad)
    with pytest.raises(checkpoint.CheckpointError, match="convert the source again"):
        rkvjax.load(bad, dtype="bfloat16")  # checked when the dtype is given too
    shutil.rmtree(bad / checkpoint.WEIGHTS)
    (bad / checkpoint.MARKER).write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="interrupted"):
        rkvjax.load(bad)


@pytest.mark.slow
def test_default_model_round_trip(smol, tmp_path):
    """The real model from its Orbax conversion: same weights, tokenizer and answer."""
    out = checkpoint.convert(smol.path, tmp_path / "smol", dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (smol.path / name).read_bytes()
    model = rkvjax.load(out, mesh=sub_mesh(1, 3))
    assert model.tokenizer.encode("The capital of France") == smol.tokenizer.encode(
        "The capital of France"
    )
    for k, v in _params(model).items():
        np.testing.assert_array_equal(v, _params(smol)[k], err_msg=k)
    r = rkvjax.generate(model, "What is the capital of France?", max_new_tokens=12)
    assert "Paris" in r.text
