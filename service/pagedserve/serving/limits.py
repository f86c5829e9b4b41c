"""Bounds on what a client may send, checked before the input costs memory or time.

Texts too long to fit: a token covers at most ``max_token_bytes`` bytes of input text, so a text of ``n`` UTF-8 bytes
is at least ``n / max_token_bytes`` tokens. When that already exceeds the limit, the text is refused from its length
alone, without tokenizing it (tokenizing a multi-megabyte prompt materializes hundreds of thousands of ids and
leaves the allocator holding the memory). The bound is exact for tokenizers without a normalizer (byte-level BPE,
whose vocabulary strings spell one character per byte, and others whose token strings spell their text); a
normalizer can shrink text (accent stripping, composition), so then the bound is relaxed by
:data:`NORMALIZER_SLACK`, which keeps it conservative (never refusing a text that fits) for all but texts made mostly
of characters the normalizer drops.
"""
from __future__ import annotations

import weakref

from ..errors import InvalidInputError

MAX_ID_CHARS = 256            # request_id, cache_salt
MAX_CHAT_MESSAGES = 4096      # messages in one chat prompt
NORMALIZER_SLACK = 8          # bytes-per-token bound multiplier when the tokenizer normalizes its input

_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_identifier(value: str | None, field: str) -> None:
    """``request_id`` / ``cache_salt``: at most :data:`MAX_ID_CHARS` printable characters.

    Raises:
        InvalidInputError: naming ``field`` (the value itself is not echoed beyond a short prefix).
    """
    if value is None:
        return
    if len(value) > MAX_ID_CHARS:
        raise InvalidInputError(f"at most {MAX_ID_CHARS} characters, got {len(value)}", field)
    if not value.isprintable():
        raise InvalidInputError("must be printable text (no control characters)", field)


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


def check_text_can_fit(num_bytes: int, limit_tokens: int, tokenizer, field: str) -> None:
    """Refuse a text of ``num_bytes`` UTF-8 bytes that cannot tokenize to ``limit_tokens`` tokens or fewer.

    Raises:
        InvalidInputError: naming ``field``, with the size and the limit.
    """
    bound = limit_tokens * max_token_bytes(tokenizer)
    if num_bytes > bound:
        raise InvalidInputError(f"{num_bytes} bytes of text cannot fit in {limit_tokens} tokens (a token covers at "
                                f"most {bound // limit_tokens} bytes); shorten it", field)
