"""Who sent a call, for fair shares among equal priorities (``--fair-share-by``; :mod:`pagedserve.core.sched.fairness`).

- ``api-key``: the name of the API key presented (``Authorization: Bearer <key>``; :meth:`ApiKeys.name_of`);
- ``header:NAME``: the value of a header (HTTP) / metadata key (gRPC) that a mesh sets after authenticating the
  caller upstream (``header:x-caller``); at most :data:`MAX_CALLER_CHARS` printable characters are kept;
- off (None): no name, every call is the same caller.

A call without the key or header is the unnamed caller ``""``. Both front ends pass their request headers
(lower-cased names) to :func:`caller_of`.
"""
from __future__ import annotations

from collections.abc import Mapping

from .auth import ApiKeys, bearer_token

MAX_CALLER_CHARS = 64


def caller_of(fair_share_by: str | None, headers: Mapping[str, str], keys: ApiKeys) -> str:
    """The caller name of a call with these ``headers`` (names lower-cased) under ``fair_share_by``."""
    if fair_share_by is None:
        return ""
    if fair_share_by == "api-key":
        return keys.name_of(bearer_token(headers.get("authorization"))) or ""
    value = headers.get(fair_share_by.removeprefix("header:").lower(), "")
    return "".join(ch for ch in value if ch.isprintable())[:MAX_CALLER_CHARS]
