"""``--speculative-config``: the parsed JSON of speculative decoding (re-exported by :mod:`pagedserve.config`)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .config_checks import _check


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON keys).

    Attributes:
        method: the proposer; "ngram" (prompt lookup decoding: drafts copied from the request's own context).
        num_speculative_tokens: drafts proposed per step, in [1, 16].
        prompt_lookup_max: longest suffix n-gram looked up in the context (>= prompt_lookup_min).
        prompt_lookup_min: shortest suffix n-gram that may propose drafts (>= 1).
        disable_by_batch_size: no drafts in a step that starts with this many running requests or more (a large
            batch is compute-bound: drafts then cost more than they save); None: never step aside.
        rejection_backoff_max: a request whose drafts were all rejected proposes none for the next 1 step, then 2,
            4, ... after further all-rejected verifications, up to this many steps; a draft accepted resets it.
            Drafts that the target model never takes (text unlike its context) then cost few verify positions.
            0: propose at every step. (Which steps carry drafts never changes the output distribution.)
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = 8
    rejection_backoff_max: int = 16

    def __post_init__(self) -> None:
        f = "speculative_config"
        _check(self.method in SPECULATIVE_METHODS, f, f"method must be one of {SPECULATIVE_METHODS}, "
               f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f,
                   f"{name} must be an integer >= 1, got {value!r}")
        _check(self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS, f,
               f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        _check(self.prompt_lookup_min <= self.prompt_lookup_max, f,
               f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
               f"({self.prompt_lookup_max})")
        d = self.disable_by_batch_size
        _check(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1), f,
               f"disable_by_batch_size must be an integer >= 1 or null, got {d!r}")
        b = self.rejection_backoff_max
        _check(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 1024, f,
               f"rejection_backoff_max must be an integer in [0, 1024], got {b!r}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse ``--speculative-config``. A missing prompt_lookup_max defaults to max(4, prompt_lookup_min).

        Raises:
            ValueError: not a JSON object, an unknown key, or a value out of range (message names the field).
        """
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"speculative_config: not valid JSON: {exc}") from None
        _check(isinstance(doc, dict), "speculative_config", f"must be a JSON object, got {text!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size", "rejection_backoff_max"}
        unknown = sorted(set(doc) - known)
        _check(not unknown, "speculative_config", f"unknown key(s) {unknown}; known: {sorted(known)}")
        if "prompt_lookup_max" not in doc and isinstance(doc.get("prompt_lookup_min"), int):
            doc["prompt_lookup_max"] = max(4, doc["prompt_lookup_min"])
        return cls(**doc)
