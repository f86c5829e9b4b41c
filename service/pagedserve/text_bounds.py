"""How long a text can be before it certainly exceeds a token limit, decided without tokenizing it.

A token covers at most ``max_token_bytes`` bytes of input text, so a text of ``n`` UTF-8 bytes is at least
``n / max_token_bytes`` tokens. When that already exceeds the limit, the text is refused from its length alone
(tokenizing a multi-megabyte input materializes hundreds of thousands of ids and leaves the allocator holding the
memory). The bound is exact for tokenizers without a normalizer (byte-level BPE, whose vocabulary strings spell one
character per byte, and others whose token strings spell their text); a normalizer can shrink text (accent
stripping, composition), so then the bound is relaxed by :data:`NORMALIZER_SLACK`, which keeps it conservative
(never refusing a text that fits) for all but texts made mostly of characters the normalizer drops.
"""
from __future__ import annotations

import weakref

from .errors import InvalidInputError

NORMALIZER_SLACK = 8          # bytes-per-token bound multiplier when the tokenizer normalizes its input

_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_bytes(tokenizer) -> int:
    """Most input bytes one token can cover (cached per tokenizer), times :data:`NORMALIZER_SLACK` when the
    tokenizer normalizes text first. Byte-level BPE vocabularies spell one character per input byte."""
    cached = _MAX_TOKEN_BYTES.get(tokenizer)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and "ByteLevel" in repr(backend.pre_tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(s) if byte_level else len(s.encode("utf-8")) for s in strings if s), default=1)
    slack = 1 if backend is not None and backend.normalizer is None else NORMALIZER_SLACK
    _MAX_TOKEN_BYTES[tokenizer] = longest * slack
    return longest * slack


def min_num_tokens(num_bytes: int, tokenizer) -> int:
    """The fewest tokens a text of ``num_bytes`` UTF-8 bytes can tokenize to (see the module docstring)."""
    return -(-num_bytes // max_token_bytes(tokenizer))


def check_text_can_fit(num_bytes: int, limit_tokens: int, tokenizer, field: str) -> None:
    """Refuse a text of ``num_bytes`` UTF-8 bytes that cannot tokenize to ``limit_tokens`` tokens or fewer.

    Raises:
        InvalidInputError: naming ``field``, with the size and the limit.
    """
    if min_num_tokens(num_bytes, tokenizer) > limit_tokens:
        bound = limit_tokens * max_token_bytes(tokenizer)
        raise InvalidInputError(f"{num_bytes} bytes of text cannot fit in {limit_tokens} tokens (a token covers at "
                                f"most {bound // limit_tokens} bytes); shorten it", field)
