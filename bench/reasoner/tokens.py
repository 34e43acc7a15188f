"""The reasoner's tokenizer, written as a Hugging Face tokenizer.json (word-level model, a
splitting pre-tokenizer, a fusing decoder) that `rkvjax.load` and transformers read like any
other.

A token is one unit of the task. An op line `a=d+b=0+2=2\n` is two tokens: the op `a=d+b` (the
same token as in the `loop` line, so writing it is a copy) and its evaluation `=0+2=2\n` (the
operands' values and the result, which they fix). A `vars` entry `a=5` is one token, as is a
keyword with its space (`round `), a round's number with its newline (`14\n`), the prompt's
round count with its keyword (`rounds 14\n`: its own tokens, so that round numbers appear only
in round lines) and an asked name with its newline (`c\n`); anything else is one character. So
every token a model writes that needs memory carries its whole value: the evaluation needs the
latest value of two variables, each of which sits in exactly one earlier token (an evaluation or
a `vars` entry) that a cache policy either kept or lost. A round spans 2 x ops + 2 tokens
whatever its number, so an op's line sits at a fixed distance from the same op's line a round
earlier. Traces of 3-5 ops over 8-20 rounds are 67-243 tokens (with the end) after a prompt of
27-31; 8 ops over 40 rounds, 723.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
KEYWORDS = ("vars ", "loop ", "rounds ", "round ", "ask ", "answer ")
NAMES = "abcdefgh"
DIGITS = "0123456789"
NUMBERS = tuple(f"{n}\n" for n in range(1, 41))  # round lines' numbers
COUNTS = tuple(f"rounds {n}\n" for n in range(1, 41))  # the prompt's round count
ASKS = tuple(f"{v}\n" for v in NAMES)
ENTRIES = tuple(f"{v}={d}" for v in NAMES for d in DIGITS)  # the vars line's
OPS = tuple(f"{t}={x}{s}{y}" for t in NAMES for x in NAMES for s in "+-" for y in NAMES)
# Every evaluation, right or wrong, so that any text in the format encodes without <unk>.
EVALS = tuple(f"={a}{s}{b}={v}\n" for a in DIGITS for s in "+-" for b in DIGITS for v in DIGITS)
CHARS = tuple(NAMES + DIGITS + "=+- \n")
# COUNTS last: the ids of the tokens before them are those of the first checkpoints' vocabulary.
VOCAB = (PAD, EOS, UNK, *KEYWORDS, *NUMBERS, *ASKS, *ENTRIES, *OPS, *EVALS, *CHARS, *COUNTS)
# First alternative that matches wins: a whole count before `rounds `, `rounds ` before
# `round `, two-digit numbers first.
_PATTERN = "|".join(
    (
        "rounds (?:40|[1-3][0-9]|[1-9])\\n",
        "rounds |round |vars |loop |ask |answer ",
        "[a-h]=[a-h][+\\-][a-h]",
        "=[0-9][+\\-][0-9]=[0-9]\\n",
        "[a-h]=[0-9]",
        "(?:40|[1-3][0-9]|[1-9])\\n",
        "[a-h]\\n",
        "[\\s\\S]",
    )
)


def build() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(_PATTERN), behavior="isolated")
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
