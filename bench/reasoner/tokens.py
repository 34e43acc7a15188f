"""The reasoner's tokenizer, written as a Hugging Face tokenizer.json (word-level model, a
splitting pre-tokenizer, a fusing decoder) that `rkvjax.load` and transformers read like any
other.

A token is a keyword with its space (`round `, `answer `, ...), a round number 10-40 with its
newline (`14\n`), a variable or digit with the sign that follows it (`d+`, `7=`, `4\n`), or any
other single character of the alphabet. An op line `a=d+b=0+2=2\n` is six tokens, each one
decision (a name or a value), so traces are half as long as one token per character would make
them: training sees twice the problems per step and a 40-round trace fits in about 2K
positions. A round's line is two tokens whatever its number, so every round of a problem spans
the same number of positions (6 x ops + 2) and an op's line sits at a fixed distance from the
same op's line a round earlier."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
KEYWORDS = ("vars ", "loop ", "rounds ", "round ", "ask ", "answer ")
SYMBOLS = "abcdefgh0123456789"
FOLLOWERS = "=+- \n"
PAIRS = tuple(s + f for s in SYMBOLS for f in FOLLOWERS)
NUMBERS = tuple(f"{n}\n" for n in range(10, 41))  # round numbers of two digits
CHARS = tuple(SYMBOLS + FOLLOWERS)
VOCAB = (PAD, EOS, UNK, *KEYWORDS, *NUMBERS, *PAIRS, *CHARS)
# Longest keyword first: `rounds ` before `round `.
_SPLIT = "|".join(sorted((k.replace(" ", "\\s") for k in KEYWORDS), key=len, reverse=True))


def build() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    pattern = f"{_SPLIT}|(?:[1-3][0-9]|40)\\n|[a-h0-9][=+\\- \\n]|[\\s\\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, EOS, UNK])
    return tok


def save(folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json into `folder`."""
    build().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "bos_token": None,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
