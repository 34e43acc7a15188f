"""`rkvjax convert`: Orbax checkpoints of converted weights, restored into any mesh."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rkvjax.convert import checkpoint
from rkvjax.models import loading

import rkvjax
from rkvjax.entrypoints import cli
from tests.test_sharding import GEN, PROMPTS, sub_mesh


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """Written from a data=4, model=2 mesh: every parameter saved as shards."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return loading.convert(source, out, dtype="float32", mesh=sub_mesh(4, 2))


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
    out = loading.convert(source, tmp_path / "one", dtype="float32")
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


class _Compiles:
    """Counts XLA compilations while inside `with`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count, self._on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **_):
        self.count += self._on and event == self.EVENT

    def __enter__(self):
        self._on = True
        return self

    def __exit__(self, *exc):
        self._on = False


def test_generate_from_converted(converted, source):
    got = rkvjax.generate(rkvjax.load(converted), PROMPTS, method="rkv", **GEN)
    # The same weights read from safetensors reuse the programs compiled for the converted
    # folder: both loads commit the weights to the same device (jit keys its cache on that).
    model = rkvjax.load(source, dtype="float32")
    with _Compiles() as compiles:
        want = rkvjax.generate(model, PROMPTS, method="rkv", **GEN)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert compiles.count == 0


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
def _with_tokenizer(source, folder):
    """The tiny model with a word-level tokenizer in the layout transformers 5 writes: the chat
    template in chat_template.jinja (none in tokenizer_config.json), named ones in
    chat_templates/, plus a legacy special_tokens_map.json and chat_template.json."""
    from tests.test_tokenizer import _write_folder

    shutil.copytree(source, folder)
    config = json.loads((source / "config.json").read_text())
    return _write_folder(
        folder,
        config=config,
        files={
            "chat_template.jinja": "{% for m in messages %}{{ m.role }} {{ m.content }} "
            "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}",
            "chat_templates/tool_use.jinja": "{{ bos_token }} hello {{ messages[0].content }}",
            "special_tokens_map.json": json.dumps({"eos_token": "world", "pad_token": "<pad>"}),
            "chat_template.json": json.dumps({"chat_template": "{{ messages[0].content }}"}),
        },
    )


def test_convert_keeps_tokenizer_and_chat_templates(source, tmp_path):
    from rkvjax.text.tokenizer import Tokenizer

    src = _with_tokenizer(source, tmp_path / "src")
    out = loading.convert(src, tmp_path / "out", dtype="float32")
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
        "chat_templates/tool_use.jinja",
    )
    for name in names:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    want, got = Tokenizer.from_dir(src), Tokenizer.from_dir(out)
    chat = [{"role": "user", "content": "hello world"}]
    assert got.chat_ids(chat) == want.chat_ids(chat) == [6, 4, 5, 7]
    tools = [{"name": "f"}]
    assert got.apply_chat_template(chat, tools=tools) == want.apply_chat_template(chat, tools=tools)
    assert got.eos_token_ids == want.eos_token_ids == (5, 2)  # special_tokens_map's, config's
    assert got.pad_token_id == want.pad_token_id == 3
    gen = dict(max_new_tokens=6, ignore_eos=True)
    a = rkvjax.generate(rkvjax.load(out), "hello world", **gen)
    b = rkvjax.generate(rkvjax.load(src, dtype="float32"), "hello world", **gen)
    assert a.token_ids == b.token_ids


@pytest.mark.slow
def test_default_model_chat_survives_conversion(smol, smol_dir, tmp_path):
    """The default model with its tokenizer saved by transformers 5 (the chat template in
    chat_template.jinja): converted and restored onto a mesh, it has the same weights; the
    converted folder renders the chat and answers exactly as before."""
    from transformers import AutoTokenizer

    from rkvjax.text.tokenizer import Tokenizer

    src = tmp_path / "smol"
    src.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(smol_dir / name, src / name)
    AutoTokenizer.from_pretrained(smol_dir).save_pretrained(src)
    assert (src / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((src / "tokenizer_config.json").read_text())
    out = loading.convert(src, tmp_path / "converted", dtype="float32")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = Tokenizer.from_dir(src).chat_ids(chat)
    assert (
        Tokenizer.from_dir(out).chat_ids(chat) == ids == Tokenizer.from_dir(smol_dir).chat_ids(chat)
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    for k, v in _params(rkvjax.load(out, mesh=sub_mesh(1, 3))).items():
        np.testing.assert_array_equal(v, _params(smol)[k], err_msg=k)
    # Generation on a mesh is tested on tiny models; here the converted folder's tokenizer and
    # chat path answer as the source does, on one device (the length of the default-model
    # tests, whose compiled programs this shares).
    prompt = chat[0]["content"]
    want = rkvjax.generate(smol, prompt, max_new_tokens=24)
    got = rkvjax.generate(rkvjax.load(out), prompt, max_new_tokens=24)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert "Paris" in got.text


# --overwrite replaces only what `rkvjax convert` wrote; these are refused before any load.


@pytest.fixture()
def no_load(monkeypatch):
    """Makes loading a model fail the test: a refused output must be refused first."""
    from rkvjax import api

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(api, "load", load)
    monkeypatch.setenv("RKVJAX_COMPILE_CACHE", "0")


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_never_deletes_the_source(source, tmp_path, no_load, capsys):
    parent = tmp_path / "models"
    src = parent / "tiny"
    shutil.copytree(source, src)
    before = _tree(parent)
    cases = [
        (parent, "contains the source"),
        (src, "is the source"),
        (src / "converted", "lies inside the source"),
    ]
    for out, match in cases:
        with pytest.raises(checkpoint.CheckpointError, match=match):
            loading.convert(src, out, overwrite=True)
        assert cli.main(["convert", str(src), str(out), "--overwrite"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], lines
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(checkpoint.CheckpointError, match="is the source"):
        loading.convert(src, link, overwrite=True)
    assert _tree(parent) == before


def test_overwrite_replaces_only_converted_or_empty_folders(source, tmp_path, no_load, capsys):
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "todo.txt").write_text("keep me")
    file = tmp_path / "file.txt"
    file.write_text("keep me too")
    for out in (mine, file):
        with pytest.raises(FileExistsError, match="not a folder written by `rkvjax convert`"):
            loading.convert(source, out, overwrite=True)
        assert cli.main(["convert", str(source), str(out), "--overwrite"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and checkpoint.MARKER in lines[0], lines
    assert (mine / "notes" / "todo.txt").read_text() == "keep me"
    assert file.read_text() == "keep me too"


def test_overwrite_refuses_the_home_folder(source, tmp_path, monkeypatch, no_load, capsys):
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert cli.main(["convert", str(source), "~", "--overwrite"]) == 2
    assert "not a folder written by `rkvjax convert`" in capsys.readouterr().err
    src = home / "tiny"  # a source in the home folder: the output contains it
    shutil.copytree(source, src)
    assert cli.main(["convert", str(src), "~", "--overwrite"]) == 2
    assert "contains the source" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["Documents", "tiny"]


def test_overwrite_protects_gguf_and_default_model_sources(tmp_path, monkeypatch, no_load):
    from tests.test_gguf import write_tiny_gguf

    (tmp_path / "models").mkdir()
    gguf = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    home = tmp_path / "rkvjax_home"
    monkeypatch.setenv("RKVJAX_HOME", str(home))
    with pytest.raises(checkpoint.CheckpointError, match="contains the source"):
        loading.convert(gguf, gguf.parent, overwrite=True)
    with pytest.raises(checkpoint.CheckpointError, match="contains the source"):
        loading.convert(gguf, home, overwrite=True)  # holds its converted cache
    with pytest.raises(checkpoint.CheckpointError, match="contains the source"):
        loading.convert(None, home / "models", overwrite=True)
    assert not home.exists()  # nothing was converted
    assert gguf.is_file()


def test_overwrite_replaces_an_empty_folder(source, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert loading.convert(source, out, dtype="float32", overwrite=True) == out
    assert checkpoint.is_converted(out)
