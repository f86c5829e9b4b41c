"""Bounds on identifiers and counts a client may send (both front ends check them through the serving layer)."""
from __future__ import annotations

from ..errors import InvalidInputError

MAX_ID_CHARS = 256            # request_id, cache_salt
MAX_CHAT_MESSAGES = 4096      # messages in one chat prompt


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
