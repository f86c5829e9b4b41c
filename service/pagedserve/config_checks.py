"""The checks every configuration dataclass runs in ``__post_init__`` (errors name the field)."""
from __future__ import annotations

from dataclasses import fields


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def _check_choices(config) -> None:
    """Every field with ``metadata["choices"]`` holds one of them (or None where None is its default). Raises
    ValueError naming the field."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        _check(choices is None or value in choices or (value is None and f.default is None), f.name,
               f"unknown value {value!r}; one of {', '.join(map(str, choices or ()))}")
