"""Text <-> token ids for the serving path, from a model directory's HF `tokenizer.json`.

Must not import torch (nor transformers): the router imports it to tokenize prompts and stream text.
`IncrementalDetokenizer` turns a token stream into text deltas whose concatenation equals `decode(all ids)`
and that never end inside a multi-byte character. Byte-level BPE tokenizers (GPT-2 style, the one
`baton make-model` ships, most modern LLMs) take an exact fast path: each id maps to its bytes and an
incremental UTF-8 decoder holds back incomplete characters. Other tokenizers (SentencePiece-style) take the
usual windowed re-decode: decode a few tokens of context plus the new ones and emit the text that grew,
unless it ends in U+FFFD (a character still incomplete).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers

# Texts longer than this (characters) are tokenized without holding the GIL.
LONG_TEXT_CHARS = 4096
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONFIG_FILE = "config.json"
REPLACEMENT_CHAR = "\ufffd"


def _byte_table(tok: Tokenizer) -> list[bytes] | None:
    """`table[id]` = the bytes `id` decodes to, if the decoder is plain ByteLevel (else None).

    Mirrors `tokenizers`' ByteLevel decoder: a token whose characters are all in the byte alphabet maps to
    those bytes, any other token (only added tokens can have other characters) to its UTF-8 text; special
    tokens decode to nothing (`skip_special_tokens=True`, the `tokenizers` default).
    """
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    char_to_byte = {c: b for b, c in enumerate(_bytes_to_unicode())}
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    vocab = tok.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if token in specials:
            continue
        try:
            table[i] = bytes(char_to_byte[c] for c in token)
        except KeyError:
            table[i] = token.encode()
    return table


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character map (`result[b]` is the character of byte b)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # Printable bytes map to themselves; the others to chr(256 + k), in byte order (GPT-2 `bytes_to_unicode`).
    out, k = [], 0
    for b in range(256):
        if chr(b) in alphabet:
            out.append(chr(b))
        else:
            out.append(chr(256 + k))
            k += 1
    assert set(out) == alphabet, "unexpected ByteLevel alphabet"
    return out


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids. `encode` adds no special token unless asked."""

    def __init__(self, tokenizer: Tokenizer, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, byte_level: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        # byte_level=False forces the generic detokenizer path (tests compare the two).
        self.token_bytes = None if byte_level is False else _byte_table(tokenizer)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (may be < the model's vocab_size; other ids decode to "")."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # `encode` holds the GIL throughout; `encode_batch` releases it (at the cost of its thread pool): a server
        # tokenizing a long text on a worker thread must not stall the threads that serve everyone else.
        if len(text) > LONG_TEXT_CHARS:
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos: this tokenizer has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped; ids the tokenizer does not know decode to ""."""
        if self.token_bytes is not None:
            return self._bytes(ids).decode("utf-8", errors="replace")
        # `tokenizers` skips unknown ids itself but cannot take negative ones.
        return self.tokenizer.decode([i for i in ids if i >= 0], skip_special_tokens=True)

    def _bytes(self, ids: Iterable[int]) -> bytes:
        table = self.token_bytes
        assert table is not None
        n = len(table)
        return b"".join(table[i] for i in ids if 0 <= i < n)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Streams text: `push(new_ids)` returns the text they complete; `flush()` the rest at the end.

    Invariant: the concatenation of every `push` and the final `flush` == `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # generic path only
        self._prefix = 0  # start of the context window re-decoded with new tokens (generic path)
        self._read = 0  # end of the ids already turned into text (generic path)

    def push(self, ids: Iterable[int]) -> str:
        if self.tokenizer.token_bytes is not None:
            # The incremental decoder keeps an incomplete trailing character until its last byte arrives.
            return self._utf8.decode(self.tokenizer._bytes(ids), final=False)
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end becomes U+FFFD)."""
        if self.tokenizer.token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        # Re-decode from `_prefix` rather than from `_read`: tokenizers like SentencePiece strip a leading
        # space at the start of a decode, so the new tokens need the previous ones as context.
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix:self._read])
        text = decode(self._ids[self._prefix:])
        if len(text) <= len(prefix_text) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text):]


def load_tokenizer(model_dir: str | Path) -> TextTokenizer | None:
    """The tokenizer of an HF model directory, or None when it has no `tokenizer.json`.

    Special ids come from `tokenizer_config.json` (bos/eos/pad token strings), else from `config.json`.
    """
    d = Path(model_dir)
    if not (d / TOKENIZER_FILE).is_file():
        return None
    tok = Tokenizer.from_file(str(d / TOKENIZER_FILE))
    tok_config = _read_json(d / TOKENIZER_CONFIG_FILE)
    config = _read_json(d / CONFIG_FILE)

    def special(name: str) -> int | None:
        token = tok_config.get(f"{name}_token")
        if isinstance(token, dict):  # {"content": "<s>", ...} (AddedToken form)
            token = token.get("content")
        if isinstance(token, str) and (i := tok.token_to_id(token)) is not None:
            return i
        i = config.get(f"{name}_token_id")
        if isinstance(i, list):  # eos_token_id may list several stop ids: the first is the EOS
            i = i[0] if i else None
        return i if isinstance(i, int) else None

    return TextTokenizer(tok, bos_id=special("bos"), eos_id=special("eos"), pad_id=special("pad"))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
