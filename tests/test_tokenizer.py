"""The tokenizer `make-model` ships and `baton.engine.tokenizer` (encode, decode, streaming deltas)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from baton.cli import make_model_cmd
from baton.engine import tokenizer_train
from baton.engine.make_model import make_model
from baton.engine.tokenizer import IncrementalDetokenizer, TextTokenizer, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café — 東京 🙂",
    "def f(x):\n    return {'a': [x, 1.5e-3]}  # comment\n\n\ttab",
    "  leading and trailing spaces  ",
    "Ünïcödé: αβγ δ, Привет, مرحبا, 👩‍👩‍👧 é (e + U+0301), \u200b zero-width",
    "",
]


@pytest.fixture(scope="module", params=["tiny", "small"])
def model_dir(request, tmp_path_factory):
    # `small` with two layers: the same 8192-token vocabulary, a fraction of the weights to write.
    overrides = {"hybrid_override_pattern": "M*"} if request.param == "small" else {}
    return make_model(tmp_path_factory.mktemp(request.param), request.param, overrides=overrides, progress=False)


@pytest.fixture(scope="module")
def tok(model_dir) -> TextTokenizer:
    t = load_tokenizer(model_dir)
    assert t is not None
    return t


def _model_vocab(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def test_make_model_writes_a_tokenizer_hf_and_tokenizers_load(model_dir, tok):
    transformers = pytest.importorskip("transformers")
    config = json.loads((model_dir / "config.json").read_text())
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == tok.vocab_size == min(config["vocab_size"], tokenizer_train.MAX_VOCAB)
    assert [raw.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (config["pad_token_id"], config["bos_token_id"],
                                                     config["eos_token_id"]) == (0, 1, 2)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert len(hf) == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == hf.encode(text) == ids  # HF adds no special token either
        assert hf.decode(ids) == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, model_dir, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size <= _model_vocab(model_dir) for i in ids)
    assert not {0, 1, 2} & set(ids)  # specials only when asked for
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [1, *ids]
    assert tok.decode([1, *ids, 2, 0]) == text  # special tokens decode to nothing


def test_bpe_merges_something(tok):
    # A trained tokenizer, not raw bytes: common words take one or two tokens.
    assert len(tok.encode(" the return value")) <= 6


def test_decode_matches_tokenizers_on_arbitrary_ids(tok, model_dir):
    # The byte table must mirror `tokenizers`' ByteLevel decoder, including invalid UTF-8 (random byte
    # tokens), special tokens and ids past the tokenizer's vocabulary (a model may sample them).
    rng = random.Random(0)
    raw = tok.tokenizer
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size + 50) for _ in range(rng.randrange(1, 20))]
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=True), ids


def _deltas(tok: TextTokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok)
    bounds = [0, *cuts, len(ids)]
    return [d.push(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [d.flush()]


@pytest.mark.parametrize("byte_level", [None, False], ids=["byte-path", "generic-path"])
def test_incremental_deltas_concatenate_to_decode_and_never_split_a_character(tok, byte_level):
    t = TextTokenizer(tok.tokenizer, tok.bos_id, tok.eos_id, tok.pad_id, byte_level=byte_level)
    assert (t.token_bytes is None) == (byte_level is False)
    rng = random.Random(1)
    for text in TEXTS:
        ids = t.encode(text)
        splits = [list(range(1, len(ids)))]  # one token at a time
        splits += [[c] for c in range(len(ids) + 1)]  # every two-piece split
        splits += [sorted(rng.sample(range(len(ids) + 1), min(len(ids), 4))) for _ in range(20)]
        for cuts in splits:
            deltas = _deltas(t, ids, cuts)
            assert "".join(deltas) == t.decode(ids) == text, (text, cuts)
            assert not any("\ufffd" in x for x in deltas), (text, cuts, deltas)


def test_incremental_holds_back_a_partial_character(tok):
    d = tok.detokenizer()
    pieces = [tok.decode([i]) for i in tok.encode("🙂")]
    if len(pieces) < 2:
        pytest.skip("the emoji is a single token in this vocabulary")
    ids = tok.encode("a🙂")
    assert [d.push([i]) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert d.push(ids[-1:]) == "🙂" and d.flush() == ""


@pytest.mark.parametrize("byte_level", [None, False], ids=["byte-path", "generic-path"])
def test_incremental_on_arbitrary_ids_matches_decode(tok, byte_level):
    t = TextTokenizer(tok.tokenizer, byte_level=byte_level)
    rng = random.Random(2)
    for _ in range(100):
        ids = [rng.randrange(t.vocab_size + 10) for _ in range(rng.randrange(1, 16))]
        d = t.detokenizer()
        assert "".join([d.push([i]) for i in ids] + [d.flush()]) == t.decode(ids), ids


def test_tokenizer_json_is_deterministic(tmp_path):
    tokenizer_train.train_tokenizer_json.cache_clear()  # really train twice
    a = make_model(tmp_path / "a", "tiny", progress=False)
    tokenizer_train.train_tokenizer_json.cache_clear()
    b = make_model(tmp_path / "b", "tiny", progress=False)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "tokenizer_config.json").read_bytes() == (b / "tokenizer_config.json").read_bytes()
    # Another process on one thread (the trainer is parallel) trains the same 8192-token vocabulary.
    code = "from baton.engine.tokenizer_train import train_tokenizer_json as t; print(t(8192), end='')"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert other.stdout == tokenizer_train.train_tokenizer_json(8192)


def test_vocab_sizes():
    assert tokenizer_train.tokenizer_vocab_size(8) is None
    assert tokenizer_train.tokenizer_vocab_size(258) is None
    assert tokenizer_train.tokenizer_vocab_size(259) == 259
    assert tokenizer_train.tokenizer_vocab_size(512) == 512
    assert tokenizer_train.tokenizer_vocab_size(131072) == 8192  # 8b-like


def test_tiny_vocab_override_writes_no_tokenizer(tmp_path, caplog):
    out = make_model(tmp_path / "m", "tiny", progress=False)
    assert (out / "tokenizer.json").is_file()
    with caplog.at_level(logging.WARNING):
        make_model(out, "tiny", overrides={"vocab_size": 8}, progress=False)  # same directory
    assert "no tokenizer" in caplog.text and "vocab_size 8" in caplog.text
    assert not (out / "tokenizer.json").exists() and not (out / "tokenizer_config.json").exists()
    assert load_tokenizer(out) is None


def test_special_ids_follow_the_config(tmp_path):
    out = make_model(tmp_path / "m", "tiny", overrides={"pad_token_id": 2, "eos_token_id": 0}, progress=False)
    t = load_tokenizer(out)
    assert t is not None and (t.pad_id, t.bos_id, t.eos_id) == (2, 1, 0)
    assert t.tokenizer.id_to_token(0) == "</s>"
    no = make_model(tmp_path / "n", "tiny", overrides={"eos_token_id": [2, 7]}, progress=False)
    assert load_tokenizer(no) is None


def test_load_tokenizer_falls_back_to_config_ids(tmp_path, model_dir):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    t = load_tokenizer(tmp_path)
    assert t is not None and (t.bos_id, t.eos_id, t.pad_id) == (1, 2, None)


def test_cli_no_tokenizer_flag(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    make_model_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-model", str(tmp_path / "m"), "--no-tokenizer"])
    assert args.run(args) == 0
    assert (tmp_path / "m" / "config.json").is_file() and load_tokenizer(tmp_path / "m") is None
    args = parser.parse_args(["make-model", str(tmp_path / "t")])
    assert args.run(args) == 0
    assert load_tokenizer(tmp_path / "t") is not None


def test_tokenizer_module_does_not_import_torch():
    # The router imports baton.engine.tokenizer; torch (seconds to import, GBs with CUDA) must stay out.
    code = ("import sys, baton.engine.tokenizer, baton.engine.tokenizer_train; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
