"""Command-line flags and environment variables derived from the config dataclasses.

Each field of :class:`~pagedserve.config.ServerConfig` and :class:`~pagedserve.config.EngineConfig` becomes exactly
one flag, ``--<field with '-' for '_'>`` (a ``bool`` field a ``--x/--no-x`` switch), and one environment variable,
``PAGEDSERVE_<FIELD>``. Type, default and choices come from the field; the help text from the class docstring's
``Attributes`` entry. Nothing here names a field: a new field needs no change in this module.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Mapping

from .envs import ENV_PREFIX

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}
_ATTR_LINE = re.compile(r"^(\s*)([a-z_][a-z0-9_]*(?:,\s*[a-z_][a-z0-9_]*)*):\s*(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` section of ``cls``'s docstring (continuation lines joined).

    Raises:
        ValueError: a field of ``cls`` has no entry (every setting must be documented).
    """
    doc = cls.__doc__ or ""
    lines = doc.split("Attributes:", 1)[1].splitlines() if "Attributes:" in doc else []
    docs: dict[str, str] = {}
    current: list[str] = []
    indent = None
    for line in lines:
        match = _ATTR_LINE.match(line)
        if match and (indent is None or len(match.group(1)) <= indent):
            indent = len(match.group(1))
            current = [n.strip() for n in match.group(2).split(",")]
            for name in current:
                docs[name] = match.group(3).strip()
        elif line.strip() and current:
            for name in current:
                docs[name] += " " + line.strip()
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
    if missing:
        raise ValueError(f"{cls.__name__}: no docstring entry for {missing}")
    return docs


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one config field appears on the command line."""

    owner: type            # the config class
    name: str              # the field name, also the argparse destination
    base_type: type        # str, int, float or bool
    optional: bool         # the field takes None
    default: object
    choices: tuple | None
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


def flag_specs(*classes: type) -> list[FlagSpec]:
    """One :class:`FlagSpec` per field of each config class, in declaration order.

    Raises:
        TypeError: a field type other than str, int, float, bool (each optionally ``| None``).
        ValueError: two classes share a field name, or a field is undocumented.
    """
    specs: list[FlagSpec] = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            args = typing.get_args(hints[f.name]) or (hints[f.name],)
            base = [a for a in args if a is not type(None)]
            if len(base) != 1 or base[0] not in (str, int, float, bool):
                raise TypeError(f"{cls.__name__}.{f.name}: unsupported field type {hints[f.name]}")
            choices = f.metadata.get("choices")
            specs.append(FlagSpec(cls, f.name, base[0], type(None) in args, f.default,
                                  tuple(choices) if choices else None, docs[f.name]))
    names = [s.name for s in specs]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        raise ValueError(f"config fields in more than one class: {sorted(duplicated)}")
    return specs


def add_flags(parser: argparse.ArgumentParser, specs: list[FlagSpec]) -> None:
    """Add one argument per spec; defaults are the dataclass defaults."""
    for spec in specs:
        group_title = spec.owner.__name__
        group = next((g for g in parser._action_groups if g.title == group_title), None) \
            or parser.add_argument_group(group_title)
        help_text = spec.help.replace("%", "%%") + f" [env {spec.env_var}]"
        if spec.base_type is bool:
            group.add_argument(spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction,
                               default=spec.default, help=help_text)
        else:
            group.add_argument(spec.flag, dest=spec.name, type=spec.base_type, default=spec.default,
                               choices=spec.choices, help=help_text,
                               metavar=spec.name.upper() if spec.choices is None else None)


def env_value(spec: FlagSpec, raw: str):
    """Convert one environment string the way the command line would.

    Raises:
        ValueError: not a value of the field's type, or not one of its choices.
    """
    if spec.base_type is bool:
        word = raw.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise ValueError(f"expected one of {sorted(TRUE_WORDS | FALSE_WORDS)}, got {raw!r}")
        return word in TRUE_WORDS
    value = spec.base_type(raw)
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{value!r} is not one of {list(spec.choices)}")
    return value


def environment_defaults(specs: list[FlagSpec], settings: Mapping[str, str]) -> tuple[dict, list[str], dict]:
    """Split ``settings`` (lower-cased name -> raw string) into (parsed defaults by field, unknown names,
    {variable: error message})."""
    by_name = {s.name: s for s in specs}
    defaults, unknown, errors = {}, [], {}
    for name, raw in settings.items():
        spec = by_name.get(name)
        if spec is None:
            unknown.append(ENV_PREFIX + name.upper())
            continue
        try:
            defaults[name] = env_value(spec, raw)
        except ValueError as exc:
            errors[spec.env_var] = str(exc)
    return defaults, unknown, errors


def build_config(cls: type, specs: list[FlagSpec], args: argparse.Namespace):
    """``cls`` from the parsed arguments of its fields. Raises ValueError (from the config's checks)."""
    return cls(**{s.name: getattr(args, s.name) for s in specs if s.owner is cls})
