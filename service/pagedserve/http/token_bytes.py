"""A token's own bytes (OpenAI's ``logprobs.content[].bytes``): what the token adds to the UTF-8 output, so the
bytes of a character split over several tokens join into that character even though no token decodes to it alone.

- Byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): each character of the token string stands for one byte through
  GPT-2's byte <-> unicode table (printable Latin-1 bytes are themselves, the other 68 bytes the code points from
  256 up, in byte order; Radford et al. 2019, ``encoder.py``), inverted here.
- SentencePiece with byte fallback (Llama 2, Mistral): ``<0xNN>`` tokens are that byte; ``▁`` is a space.
- Added (special) tokens and anything else: the token's text encoded as UTF-8.
"""
from __future__ import annotations

import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def unicode_to_byte() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte table (256 entries)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))


class TokenBytes:
    """``token_bytes(token_id) -> bytes`` for one tokenizer, cached per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._added = set(tokenizer.get_added_vocab())
        self._cache: dict[int, bytes] = {}
        self._unicode_to_byte: dict[str, int] | None = None
        if _byte_level(tokenizer):
            self._unicode_to_byte = unicode_to_byte()

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._compute(token_id)
        return out

    def _compute(self, token_id: int) -> bytes:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if token in self._added:
            return token.encode("utf-8")
        if self._unicode_to_byte is not None and all(c in self._unicode_to_byte for c in token):
            return bytes(self._unicode_to_byte[c] for c in token)
        match = _BYTE_FALLBACK.match(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
