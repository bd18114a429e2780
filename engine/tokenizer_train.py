"""Build the small byte-level BPE tokenizer that `baton make-model` ships next to its random weights.

Why train at make-model time instead of shipping a vocabulary file: training takes ~0.3 s, needs no network
and no data file in the repo. The corpus is text every Python install has: the Python documentation topics
(`pydoc_data.topics`, English prose) and a fixed list of standard-library sources (code), read in a fixed
order with byte caps. The `tokenizers` BPE trainer is deterministic (merge ties break on token ids, the
alphabet is sorted; same output with 1 or many threads), so `tokenizer.json` is a pure function of (vocab
size, Python stdlib files, `tokenizers` version): identical for the same Python build, possibly different
across Python versions. That is enough, since a tokenizer only has to match the checkpoint it ships with.

Byte-level means any text round-trips (every byte is a token) and decoding never needs an unknown token.
Special tokens `<pad>`, `<s>`, `</s>` take ids 0, 1, 2: the pad/bos/eos ids of `make_model._COMMON`.
"""

from __future__ import annotations

import json
import logging
import sysconfig
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# A bigger vocabulary buys nothing for a random model and costs training time; 8192 = the `small` preset.
MAX_VOCAB = 8192
MIN_VOCAB = 256 + 3  # every byte + the three special tokens

# Stdlib sources (relative to the stdlib directory) for the code half of the corpus; missing ones are
# skipped (e.g. a module that became a package), which keeps the choice deterministic per Python build.
CODE_FILES = (
    "argparse.py", "ast.py", "calendar.py", "configparser.py", "csv.py", "dataclasses.py", "difflib.py",
    "enum.py", "fractions.py", "functools.py", "inspect.py", "json/encoder.py", "logging/__init__.py",
    "pathlib.py", "pprint.py", "random.py", "shutil.py", "statistics.py", "string.py", "subprocess.py",
    "textwrap.py", "threading.py", "typing.py", "zipfile.py", "email/message.py", "http/client.py",
)
PROSE_BYTES = 512 * 1024
CODE_BYTES_PER_FILE = 32 * 1024


def corpus() -> list[str]:
    """The training texts: ~512 KiB of documentation prose, then ~32 KiB of each file of `CODE_FILES`."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics  # a dict {topic: text}, generated from the Python docs
    except ImportError:  # some distributions split pydoc_data out; code alone still trains a fine tokenizer
        topics = {}
    prose = "\n\n".join(topics[k] for k in sorted(topics)).encode()[:PROSE_BYTES]
    texts.append(prose.decode("utf-8", errors="ignore"))  # "ignore": the cut may split a character
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CODE_FILES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_bytes()[:CODE_BYTES_PER_FILE].decode("utf-8", errors="ignore"))
    return texts


def tokenizer_vocab_size(model_vocab_size: int) -> int | None:
    """The vocabulary size of the shipped tokenizer for a model of `model_vocab_size`; None if none fits."""
    return None if model_vocab_size < MIN_VOCAB else min(model_vocab_size, MAX_VOCAB)


@lru_cache(maxsize=8)  # tests write many tiny checkpoints: train once per process and size
def train_tokenizer_json(vocab_size: int, special_tokens: tuple[str, ...] = (PAD, BOS, EOS)) -> str:
    """Train the byte-level BPE on `corpus()`; return its `tokenizer.json` text. Specials get ids 0, 1, ..."""
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size: a byte-level tokenizer needs >= {256 + len(special_tokens)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # No prefix space: encode(a + b) == encode(a) + encode(b) more often, and decode is an exact inverse.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok.to_str(pretty=True)


def _special_tokens(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """PAD/BOS/EOS ordered by the config's ids, which must be 0, 1, 2 in some order (else None)."""
    ids = (config.get("pad_token_id"), config.get("bos_token_id"), config.get("eos_token_id"))
    if not all(isinstance(i, int) for i in ids) or sorted(ids) != [0, 1, 2]:  # e.g. eos_token_id: [2, 11]
        return None
    by_id = dict(zip(ids, (PAD, BOS, EOS), strict=True))
    return tuple(by_id[i] for i in range(3))


def write_tokenizer(out_dir: str | Path, config: Mapping[str, Any]) -> Path | None:
    """Write `tokenizer.json` + `tokenizer_config.json` for the HF `config` into `out_dir`; return the former.

    Returns None, after a warning and after removing tokenizer files a previous run left (they would not
    match the new checkpoint), when no byte-level tokenizer fits: vocab_size < 259, or pad/bos/eos ids
    other than a permutation of 0, 1, 2.
    """
    out = Path(out_dir)
    vocab = tokenizer_vocab_size(int(config["vocab_size"]))
    specials = _special_tokens(config)
    if vocab is None or specials is None:
        why = (f"vocab_size {config['vocab_size']} < {MIN_VOCAB} (256 bytes + 3 special tokens)" if vocab is None
               else "pad/bos/eos_token_id are not 0, 1, 2 in some order")
        logger.warning("%s: no tokenizer written: %s; prompts must be token ids", out, why)
        for stale in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            (out / stale).unlink(missing_ok=True)
        return None
    (out / TOKENIZER_FILE).write_text(train_tokenizer_json(vocab, specials) + "\n")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
        # Nothing added on encode (callers prepend BOS when they want it) and nothing rewritten on decode, so
        # HF and `baton.engine.tokenizer` agree and decode(encode(text)) == text.
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.get("max_position_embeddings") or 8192),
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    return out / TOKENIZER_FILE
