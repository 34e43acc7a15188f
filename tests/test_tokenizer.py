"""Tokenizer and chat template against transformers; SmolLM2 tokens against llama.cpp's rules."""

from __future__ import annotations

import itertools
import json

import pytest
from rkvjax.convert.default_model import default_gguf_path

from rkvjax.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }  // comment",
    "12345",
    "pi is 3.14159, e is 2.71828",
    "x = 1,000,000 and 2^10=1024",
    " 1 2  33   444",
    "Version 2.0.1 (2024-11-29) costs $19.99",
    "mixed 42abc abc42 4.2e-3 -17",
    "x²+y³=z½, ١٢٣ and ⅫⅢ",
    " ² ³",
    "naïve café résumé Straße",
    "日本語のテキストです。中文文本。한국어",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧",
    "tabs\tand\t\ttabs",
    "trailing spaces   ",
    "   leading spaces",
    "lines\n\n\nmany\r\nwindows\n",
    "I'm sure they're fine, we've seen it; you'll see, he'd say",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more<repo_name>x",
    "<|im_start|><|im_end|>",
    "",
    " ",
    "\n",
]

CHATS = {
    "one message": [{"role": "user", "content": "What is the capital of France?"}],
    "system and user": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": "Now backwards, 😀 please."},
    ],
}


@pytest.fixture(scope="module")
def ours(smol_dir):
    return Tokenizer.from_dir(smol_dir)


@pytest.fixture(scope="module")
def hf(smol_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def gguf_vocab():
    """(tokens, merges, token types) as stored in the GGUF, read by transformers' reader."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    meta, _ = read_gguf_metadata(str(default_gguf_path()), keys)
    return tuple(meta[k] for k in keys)


def _split_keep_gaps(pattern, text):
    """llama.cpp's unicode_regex_split: the matches and the unmatched text between them."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        pieces += [text[pos : m.start()], m.group()]
        pos = m.end()
    return [p for p in [*pieces, text[pos:]] if p]


def llama_cpp_smollm_reference(text, tokens, merges, token_types):
    """What llama.cpp does for `tokenizer.ggml.pre = "smollm"` (llama-vocab.cpp): control tokens
    are matched whole, then the regexes ["\\p{N}", GPT-2's] split the text in turn, and each
    piece is byte-level BPE-encoded with the file's merges (lowest rank first)."""
    import regex
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    byte_char = bytes_to_unicode()
    control = [t for t, ty in zip(tokens, token_types, strict=True) if ty == 3]
    control.sort(key=len, reverse=True)
    specials = regex.compile("(" + "|".join(regex.escape(t) for t in control) + ")")
    digits = regex.compile(r"\p{N}")
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")
    ids = []
    for i, part in enumerate(specials.split(text)):
        if i % 2:
            ids.append(vocab[part])
            continue
        for chunk in _split_keep_gaps(digits, part):
            for piece in _split_keep_gaps(gpt2, chunk):
                word = ["".join(byte_char[b] for b in ch.encode()) for ch in piece]
                word = list("".join(word))
                while len(word) > 1:
                    pairs = set(itertools.pairwise(word))
                    best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
                    if best not in ranks:
                        break
                    merged, j = [], 0
                    while j < len(word):
                        if j + 1 < len(word) and (word[j], word[j + 1]) == best:
                            merged.append(word[j] + word[j + 1])
                            j += 2
                        else:
                            merged.append(word[j])
                            j += 1
                    word = merged
                ids += [vocab[w] for w in word]
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf, text):
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add)
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_encode_matches_llama_cpp_rules(ours, gguf_vocab):
    for text in TEXTS:
        assert ours.encode(text) == llama_cpp_smollm_reference(text, *gguf_vocab), text


@pytest.mark.slow
def test_explicit_digit_splits(ours, gguf_vocab):
    tokens = gguf_vocab[0]
    spelled = {
        "12345": ["1", "2", "3", "4", "5"],
        "3.14": ["3", ".", "1", "4"],
        " 1 2  33": ["Ġ", "1", "Ġ", "2", "ĠĠ", "3", "3"],
        " ²": ["Ġ", "Â²"],  # "²" is \p{N}: split off before the GPT-2 regex sees " ²"
        "<|im_start|>7<|im_end|>": ["<|im_start|>", "7", "<|im_end|>"],
    }
    for text, expected in spelled.items():
        assert [tokens[i] for i in ours.encode(text)] == expected, text


@pytest.mark.slow
def test_transformers_gguf_tokenizer_agrees_without_numerals(ours, gguf_vocab):
    # transformers builds this GGUF's tokenizer as GPT2Tokenizer without the digit split that
    # `pre = "smollm"` stands for, so it is a reference only on text with no \p{N} characters:
    # on " 1 2  33" it gives ...Ġ Ġ 3 3 where llama.cpp and SmolLM2's tokenizer.json give ĠĠ 3 3.
    import regex
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    # The class AutoTokenizer picks for a GGUF; called directly it skips parsing the whole file
    # for a model config (4 s).
    path = default_gguf_path()
    theirs = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    plain = [t for t in TEXTS if not regex.search(r"\p{N}", t)]
    assert len(plain) > 15
    for text in plain:
        assert ours.encode(text) == theirs.encode(text), text


@pytest.mark.slow
def test_batch_and_properties(ours, hf):
    assert ours.encode_batch(TEXTS[:5]) == [ours.encode(t) for t in TEXTS[:5]]
    assert ours.vocab_size == len(hf) == 49152
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert ours.pad_token_id == hf.pad_token_id == 2
    assert ours.has_chat_template
    assert ours.special_tokens == hf.special_tokens_map


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, hf, name, gen):
    chat = CHATS[name]
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=gen) == text
    assert ours.chat_ids(chat, add_generation_prompt=gen) == ids
    # transformers tokenizes the rendered chat without adding special tokens of its own.
    assert ids == hf.encode(text, add_special_tokens=False)


# Small synthetic folders: chat-template sources, template features, ids, errors.


def _write_folder(path, *, tokenizer_config=None, files=None, config=None, generation=None):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path.mkdir(parents=True, exist_ok=True)
    words = ["<unk>", "<s>", "</s>", "<pad>", "hello", "world", "user", "assistant", ",", "?"]
    backend = Backend(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    backend.save(str(path / "tokenizer.json"))
    tk = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>"}
    tk.update(tokenizer_config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(tk))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


FEATURES = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m.role }}: {{ m.content }}\n"
    "{% if m.get('thinking') %}[{{ m.thinking }}|{{ m.reasoning_content }}]{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}{{ ns.n }} {{ {'k': '<é&>'} | tojson }} {{ messages | length }}"
    "{{ dict(a=1) | tojson }}{% if add_generation_prompt %}assistant:{% endif %}"
    "{{ strftime_now('%Y') }}{{ pad_token is defined }}{{ extra | default('') }}"
)


def test_template_features_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = _write_folder(
        tmp_path / "m",
        tokenizer_config={
            "chat_template": FEATURES,
            "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        },
    )
    ours, hf = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    chat = [
        {"role": "user", "content": "hello", "name": None},
        {"role": "skip", "content": "dropped"},
        {"role": "assistant", "content": "world", "reasoning": "because"},
    ]
    for gen in (True, False):
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
    expected = hf.apply_chat_template(chat, tokenize=False, extra="X")
    assert ours.apply_chat_template(chat, add_generation_prompt=False, extra="X") == expected
    assert "[because|because]" in expected and '{"k": "<é&>"}' in expected


def test_raise_exception_in_template(tmp_path):
    import jinja2

    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    folder = _write_folder(tmp_path / "m", tokenizer_config={"chat_template": template})
    with pytest.raises(jinja2.TemplateError, match="user first"):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "assistant", "content": "x"}])


def test_prompts_a_template_refuses_are_named(tmp_path):
    """A chat the template raises on, or a "tool" message for a template without that role,
    is one ValueError naming the prompt (not a jinja2 traceback)."""
    from rkvjax.runtime import requests

    template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    template += "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = Tokenizer.from_dir(
        _write_folder(tmp_path / "m", tokenizer_config={"chat_template": template})
    )
    with pytest.raises(
        ValueError, match=r"^prompt 3: the chat template of .*m refuses this chat: user first$"
    ):
        requests.encode(tok, [{"role": "system", "content": "x"}], None, "prompt 3")
    with pytest.raises(ValueError, match="prompt 3: chat\\[1\\]: role 'tool', which this model's"):
        chat = [{"role": "user", "content": "hello"}, {"role": "tool", "content": "world"}]
        requests.encode(tok, chat, None, "prompt 3")
    assert requests.encode(tok, [{"role": "user", "content": "hello"}], None) == tok.chat_ids(
        [{"role": "user", "content": "hello"}]
    )


def test_template_sources_follow_transformers_priority(tmp_path):
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T"}]  # fmt: skip
    cases = {
        "list": _write_folder(tmp_path / "list", tokenizer_config={"chat_template": named}),
        "jinja file wins": _write_folder(
            tmp_path / "jinja",
            tokenizer_config={"chat_template": "CONFIG"},
            files={"chat_template.jinja": "FILE{{ messages[0].content }}"},
        ),
        "template folder": _write_folder(
            tmp_path / "dir",
            files={
                "chat_template.jinja": "FILE{{ messages[0].content }}",
                "chat_templates/other.jinja": "OTHER",
            },
        ),
    }
    chat = [{"role": "user", "content": "hello"}]
    for name, folder in cases.items():
        expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False)
        assert Tokenizer.from_dir(folder).apply_chat_template(chat) == expected, name
    assert expected == "FILEhello"
    assert Tokenizer.from_dir(cases["list"]).apply_chat_template(chat, tools=[{}]) == "T"


def test_eos_ids_merge_tokenizer_generation_and_model_configs(tmp_path):
    folder = _write_folder(
        tmp_path / "m",
        tokenizer_config={"eos_token": {"content": "</s>", "special": True}, "pad_token": None},
        config={"model_type": "llama", "eos_token_id": [5, 2], "pad_token_id": 7},
        generation={"eos_token_id": 6, "pad_token_id": 3},
    )
    tok = Tokenizer.from_dir(folder)
    assert tok.eos_token_ids == (2, 6, 5)
    assert tok.pad_token_id == 3  # no pad token: generation_config wins over config
    assert tok.encode("hello <s> world") == [4, 1, 5]
    assert tok.decode([4, 1, 5]) == "hello world"
    assert tok.decode([4, 1, 5], skip_special_tokens=False) == "hello <s> world"


def test_token_named_in_config_but_absent_is_added_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = _write_folder(tmp_path / "m", tokenizer_config={"pad_token": "<extra_pad>"})
    ours, hf = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.pad_token_id == hf.pad_token_id == 10
    assert ours.encode("hello<extra_pad>") == hf.encode("hello<extra_pad>") == [4, 10]


def test_decode_clean_up_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    # transformers applies its legacy clean-up only to non-BPE models (this one is WordLevel).
    folder = _write_folder(tmp_path / "m", tokenizer_config={"clean_up_tokenization_spaces": True})
    ours, hf = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    ids = ours.encode("hello , world ?")
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "hello, world?"


def test_missing_files_and_templates(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    folder = _write_folder(tmp_path / "plain")
    tok = Tokenizer.from_dir(folder)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match=f"{folder}.*no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    folder = _write_folder(
        tmp_path / "named", tokenizer_config={"chat_template": [{"name": "a", "template": "A"}]}
    )
    with pytest.raises(ValueError, match=r"none is named 'default': \['a'\]"):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    folder = _write_folder(tmp_path / "t", tokenizer_config={"chat_template": "x"})
    with pytest.raises(ValueError, match="empty conversation"):
        Tokenizer.from_dir(folder).apply_chat_template([])
