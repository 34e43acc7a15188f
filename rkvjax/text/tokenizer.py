"""Tokenizer: Hugging Face tokenizer.json plus the Jinja chat template, run as transformers does."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import tokenizers

# Named special tokens, in transformers' SPECIAL_TOKENS_ATTRIBUTES order; the chat template sees
# each one that is set as a variable of the same name.
_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers passes a message's reasoning under all of these; templates read different ones.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Where transformers 5 saves chat templates: one file, and a folder of named ones.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Characters above which `encode` goes through `encode_batch`: the tokenizers library holds the
# GIL in `encode` (1 MiB took 1.2 s, during which a server's other threads stood still) and
# releases it in `encode_batch`.
_LONG_TEXT = 16_384
CHAT_TEMPLATE_DIR = "chat_templates"
# Every file `Tokenizer.from_dir` reads (besides CHAT_TEMPLATE_DIR): a copy of a model folder
# that keeps these keeps its tokenizer, chat template and stop tokens.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    CHAT_TEMPLATE_FILE,
)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read."""


class Tokenizer:
    """Encodes, decodes and renders chats exactly as `transformers.AutoTokenizer` does.

    The pipeline is the folder's tokenizer.json, used as written. transformers 5 does the same for
    `TokenizersBackend` / `PreTrainedTokenizerFast` folders; for a folder that names a class with
    its own constructor (e.g. `GPT2Tokenizer`) it rebuilds the pipeline from the vocabulary, which
    can drop steps such as SmolLM's digit split. There this class still follows tokenizer.json,
    which is what the model was trained with.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int | None = None,
        clean_up_tokenization_spaces: bool = False,
        name: str = "<tokenizer>",
    ):
        """Wraps a `tokenizers.Tokenizer`; most callers want `Tokenizer.from_dir`.

        Args:
            backend: the tokenizers pipeline (normalizer, pre-tokenizer, model, decoder).
            special_tokens: named special tokens ("bos_token", "eos_token", ...) -> token string.
            chat_template: a Jinja template, or {name: template} with a "default" entry.
            eos_token_ids: ids that end a generation, most important first.
            pad_token_id: id used for padding, or None.
            clean_up_tokenization_spaces: transformers' legacy decode clean-up (never for BPE).
            name: where the tokenizer came from, for error messages.
        """
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._chat_template = chat_template
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._pad_token_id = pad_token_id
        # transformers skips the clean-up for BPE models: it would delete real spaces.
        model_kind = type(backend.model).__name__
        self._clean_up = clean_up_tokenization_spaces and model_kind != "BPE"
        self.name = name

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
        """Loads tokenizer.json, tokenizer_config.json and the chat template from a model folder.

        Args:
            path: a Hugging Face model folder.

        Returns:
            The tokenizer, or None when the folder has no tokenizer.json.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        backend = _read_backend(path / "tokenizer.json")
        tk_config = _read_json(path / "tokenizer_config.json")
        special = {k: _token_content(tk_config.get(k)) for k in _SPECIAL_NAMES}
        legacy_map = path / "special_tokens_map.json"
        if "added_tokens_decoder" not in tk_config and legacy_map.is_file():
            # transformers reads this legacy file only when tokenizer_config lacks the added tokens.
            for k, v in _read_json(legacy_map).items():
                if k in _SPECIAL_NAMES and v is not None:
                    special[k] = _token_content(v)
        _add_missing_tokens(backend, tk_config, special)

        def token_id(token: str | None) -> int | None:
            return None if token is None else backend.token_to_id(token)

        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        eos = [token_id(special.get("eos_token"))]
        eos += _as_ids(gen_config.get("eos_token_id")) + _as_ids(model_config.get("eos_token_id"))
        pad = token_id(special.get("pad_token"))
        for fallback in (gen_config, model_config):
            if pad is None:
                pad = fallback.get("pad_token_id")
        return cls(
            backend,
            special_tokens=special,
            chat_template=_load_chat_template(path, tk_config),
            eos_token_ids=[i for i in eos if i is not None],
            pad_token_id=None if pad is None else int(pad),
            clean_up_tokenization_spaces=bool(tk_config.get("clean_up_tokenization_spaces", False)),
            name=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the tokenizer's eos token, then generation_config.json's and
        config.json's `eos_token_id` (an int or a list), without repeats."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id; else generation_config.json's, then config.json's pad_token_id."""
        return self._pad_token_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens that are set, e.g. {"eos_token": "<|im_end|>"}."""
        return dict(self._special)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template_source(self) -> str | None:
        """The text of the chat template(s), for checks of what a template handles."""
        template = self._chat_template
        return "\n".join(template.values()) if isinstance(template, dict) else template

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids; special tokens written in the text are matched whole."""
        if len(text) > _LONG_TEXT:  # `encode_batch` lets other threads run meanwhile
            return self.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def stream(self, *, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """An incremental decoder of one generation: `step(token)` returns the text that token
        completes (None while it ends inside a character). Each token is decoded once, in Rust
        (the tokenizers library's DecodeStream), about 1 us a token. Without the clean-up of
        `decode` (which no BPE tokenizer has)."""
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._backend)

    def decode_raw(self, ids: Sequence[int]) -> str:
        """Token ids -> text as `stream()` writes it: special tokens skipped, no clean-up."""
        return self._backend.decode(list(ids), skip_special_tokens=True)

    @functools.cached_property
    def _token_texts(self) -> tuple[list[str], np.ndarray]:
        """Each token's text after an ASCII letter, as a stream decodes it (U+FFFD where the
        token ends inside a character), and its length in UTF-8 bytes [V]: one batch decode of
        the vocabulary, once (about 50 ms for 49K tokens)."""
        ctx = self._backend.encode("a", add_special_tokens=False).ids[-1:]
        lead = len(self._backend.decode(ctx, skip_special_tokens=True))
        texts = self._backend.decode_batch(
            [[*ctx, v] for v in range(self.vocab_size)], skip_special_tokens=True
        )
        texts = [t[lead:] for t in texts]
        lengths = np.fromiter((len(t.encode()) for t in texts), np.int64, len(texts))
        return texts, np.append(lengths, 0)

    def token_byte_lengths(self) -> np.ndarray:
        """[V + 1] int64 each token's text's length in UTF-8 bytes (0 for special tokens), and
        a last 0, which ids past the vocabulary clip onto (they decode to nothing)."""
        return self._token_texts[1]

    def stop_candidates(self, stop: tuple[str, ...]) -> np.ndarray:
        """[V + 1] bool: the tokens that can complete one of the `stop` strings, those whose
        text holds a stop string's last character or ends inside a character (then what it
        completes is not known alone), and a last True, which ids past the vocabulary (a
        model's padded embedding) clip onto. Cached per stop set."""
        cache = self.__dict__.setdefault("_stop_candidates", {})
        if stop not in cache:
            if len(cache) >= 256:
                cache.pop(next(iter(cache)))
            last = {s[-1] for s in stop} | {"\ufffd"}
            texts, _ = self._token_texts
            hits = np.fromiter((not last.isdisjoint(t) for t in texts), bool, len(texts))
            cache[stop] = np.append(hits, True)
        return cache[stop]

    @property
    def cleans_up(self) -> bool:
        """Whether `decode` removes spaces before punctuation (transformers'
        clean_up_tokenization_spaces, which BPE tokenizers skip)."""
        return self._clean_up

    @staticmethod
    def clean_up(text: str) -> str:
        """The clean-up `decode` applies when `cleans_up`."""
        return _clean_up(text)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text. Invalid UTF-8 byte sequences decode to U+FFFD, as in transformers."""
        text = self._backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_vars: Any,
    ) -> str:
        """Renders a chat to a prompt string like `apply_chat_template(tokenize=False)` does.

        Args:
            messages: [{"role": ..., "content": ...}, ...]; keys whose value is None are dropped.
            add_generation_prompt: end with the header that opens the assistant's turn.
            tools: JSON schemas for templates that support tool use.
            **template_vars: extra template variables, e.g. `enable_thinking=False` (Qwen3).

        Returns:
            The rendered prompt; it contains special tokens as text.
        """
        template = self._select_template(tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = [_plain_message(m) for m in messages]
        variables = {**self._special, **_plain(template_vars)}
        return _compile(template).render(
            messages=chat,
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int]:
        """Renders a chat and encodes it; like transformers, the template alone supplies special
        tokens (no BOS is added on top of the one it may write)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )
        return self.encode(text, add_special_tokens=False)

    def _select_template(self, tools) -> str:
        template = self._chat_template
        if template is None:
            raise ValueError(
                f"{self.name} has no chat template (looked for chat_template.jinja and "
                "`chat_template` in tokenizer_config.json); pass raw prompts instead"
            )
        if isinstance(template, str):
            return template
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError(
            f"{self.name} has several chat templates and none is named 'default': "
            f"{sorted(template)}"
        )


def _read_backend(path: Path) -> tokenizers.Tokenizer:
    """tokenizer.json's pipeline, or TokenizerError naming the file."""
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust reader raises a bare Exception for any bad file
        raise TokenizerError(
            f"{path}: not a readable tokenizers file ({e}); restore it from the model's original "
            "folder"
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} when there is no such file), or TokenizerError naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes())
    except ValueError as e:  # invalid JSON, or bytes that are no UTF-8/16/32 text
        raise TokenizerError(
            f"{path}: not valid JSON ({e}); restore it from the model's original folder"
        ) from None
    if not isinstance(data, dict):
        raise TokenizerError(
            f"{path}: expected a JSON object ({{...}}), found a {type(data).__name__}; restore "
            "it from the model's original folder"
        )
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _add_missing_tokens(backend, tk_config: dict[str, Any], special: dict[str, str | None]):
    """Adds the tokens tokenizer_config declares but tokenizer.json lacks, as transformers does."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    new = []
    for entry in tk_config.get("added_tokens_decoder", {}).values():
        if isinstance(entry, dict) and entry.get("content") not in present:
            fields = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
            new.append(tokenizers.AddedToken(**{k: entry[k] for k in fields if k in entry}))
            present.add(entry["content"])
    for token in special.values():
        if token is not None and token not in present:
            new.append(tokenizers.AddedToken(token, special=True))
            present.add(token)
    if new:
        backend.add_tokens(new)


def _load_chat_template(path: Path, tk_config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja and chat_templates/*.jinja win over tokenizer_config's `chat_template`
    (a string, or a list of {"name", "template"}), the order transformers 5 uses."""
    templates = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = tk_config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`: the same replacements in the same order."""
    for s in (".", "?", "!", ",", "' ", "n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(" " + s, s if s != "' " else "'")
    return text


def _plain(value: Any) -> Any:
    """A copy built from JSON types only: the sandbox cannot vouch for other objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    msg = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
    if reasoning is not None:
        # Same key order as transformers, for templates that iterate over a message's items.
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The template compiled in the sandbox, globals and filters that transformers defines."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}` only marks assistant spans for training masks; render its body.
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        # Only construction: attribute access on `dict` itself could reach Python internals.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace: {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
