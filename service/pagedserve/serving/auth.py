"""API keys shared by both front ends: ``--api-key`` and/or ``--api-key-file`` (one key per line, ``#`` comments;
a line ``<key> <name>`` names its caller for fair shares, ``--fair-share-by api-key``).

The file is re-read when it changes (checked at most once a second), so a key can be rotated without downtime: add
the new key, move the clients over, remove the old one. A presented key is compared with every configured key
through ``hmac.compare_digest`` on SHA-256 digests, so the time taken depends neither on how much of a key matches
nor on the presented key's length.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time

import structlog

log = structlog.get_logger(__name__)

RECHECK_S = 1.0


class ApiKeys:
    """The accepted keys. ``enabled`` is false when neither a key nor a key file is configured.

    Raises (constructor):
        ValueError: the key file has no key.
        OSError: the key file cannot be read.
    """

    def __init__(self, api_key: str | None = None, api_key_file: str | None = None):
        self._fixed = [api_key] if api_key else []
        self._file = api_key_file
        self._lock = threading.Lock()
        self._file_stamp: tuple[float, int] | None = None
        self._checked_at = 0.0
        self._digests: list[bytes] = []
        self._names: list[str] = []
        self._reload(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self._fixed) or self._file is not None

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked_at < RECHECK_S:
            return
        with self._lock:
            self._checked_at = now
            keys = list(self._fixed)
            names = ["default"] * len(keys)
            if self._file is not None:
                st = os.stat(self._file)
                stamp = (st.st_mtime, st.st_size)
                if not force and stamp == self._file_stamp:
                    return
                with open(self._file, encoding="utf-8") as f:
                    entries = [line.split(maxsplit=1) for line in f
                               if line.strip() and not line.lstrip().startswith("#")]
                from_file = [e[0] for e in entries]
                if not from_file and not keys:
                    raise ValueError(f"api_key_file: {self._file} holds no key")
                if self._file_stamp is not None:
                    log.info("api_keys_reloaded", num_keys=len(from_file))
                self._file_stamp = stamp
                keys += from_file
                names += [e[1].strip() if len(e) > 1 else _pseudonym(e[0]) for e in entries]
            self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
            self._names = names

    def check(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the keys (True when no key is configured)."""
        if not self.enabled:
            return True
        return self.name_of(presented) is not None

    def name_of(self, presented: str | None) -> str | None:
        """The caller name of the key ``presented`` (its key-file name, ``key-<8 hex of its SHA-256>`` without
        one, ``default`` for --api-key); None when it is not an accepted key or no key is configured."""
        if not self.enabled:
            return None
        try:
            self._reload()
        except (OSError, ValueError):
            log.exception("api_key_file_unreadable")  # keep the keys read last time
        digest = hashlib.sha256((presented or "").encode()).digest()
        found = None
        for key, name in zip(self._digests, self._names):  # every key is compared: no early exit
            if hmac.compare_digest(digest, key) and found is None:
                found = name
        return found if presented is not None else None

    def check_authorization(self, header: str | None) -> bool:
        """Whether an ``Authorization: Bearer <key>`` header value carries an accepted key."""
        if not self.enabled:
            return True
        return self.check(bearer_token(header))


def bearer_token(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value (None for another scheme or none)."""
    scheme, _, token = (header or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _pseudonym(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
