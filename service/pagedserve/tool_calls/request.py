"""A request's tools and ``tool_choice`` (OpenAI's shapes, vLLM's semantics) -> what the server does with them.

- ``none``: no calls; the tools are still rendered into the prompt for templates that show them.
- ``auto`` (the default when ``tools`` is given): the model decides; its text goes through the server's
  ``--tool-call-parser``. Without ``--enable-auto-tool-choice`` this is a 400, as in vLLM.
- ``required``: at least one call, enforced by structured output: a JSON array of ``{"name", "parameters"}``
  objects, each a listed function with arguments valid for its schema (one call at most when
  ``parallel_tool_calls`` is false).
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is that function's
  arguments, constrained by its ``parameters`` schema.

A function that declares no parameters is called with exactly ``{}`` (:func:`arguments_schema`).

Errors are :class:`~pagedserve.errors.InvalidInputError` naming the body field (``tools[1].function.name``,
``tool_choice``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidInputError
from .parsers import NamedCallParser, RequiredCallsParser, ToolParser, make_parser

MAX_TOOLS = 128
"""Most functions per request (each adds a branch to the ``required`` constraint)."""
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments schema of a function that takes none: exactly ``{}``."""
# Keys that say nothing about which properties an object may hold (with no properties, no required ones).
_ANNOTATION_KEYS = frozenset({"type", "properties", "required", "title", "description", "$schema"})
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the server."""

    tools: tuple[dict, ...]            # OpenAI tool objects as sent (handed to the chat template as ``tools``)
    mode: str                          # "none", "auto", "required" or "named"
    name: str | None = None            # the function, when named
    parallel: bool = True              # parallel_tool_calls
    parser_name: str | None = None     # auto: the server's --tool-call-parser

    @property
    def schema(self) -> dict | None:
        """The JSON schema the output is held to (required / named), else None."""
        functions = {t["function"]["name"]: arguments_schema(t["function"].get("parameters")) for t in self.tools}
        if self.mode == "named":
            return functions[self.name]
        if self.mode != "required":
            return None
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for n, p in functions.items()]}
        return {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}

    @property
    def max_calls(self) -> int | None:
        """Calls reported per choice: 1 without ``parallel_tool_calls`` (an ``auto`` model that emits more keeps its
        first, as vLLM does), else all."""
        return None if self.parallel else 1

    def parser(self) -> ToolParser | None:
        """A fresh parser of this request's output (None for ``none``)."""
        if self.mode == "named":
            return NamedCallParser(self.name)
        if self.mode == "required":
            return RequiredCallsParser()
        return make_parser(self.parser_name) if self.mode == "auto" else None


def arguments_schema(parameters: dict | None) -> dict:
    """The schema a forced call's arguments are held to: the function's ``parameters``, or for a function that
    declares no parameters (``parameters`` absent or ``{}``, or an object schema with no properties and nothing
    else said about them, as pydantic and LangChain write a function without arguments) exactly ``{}``
    (:data:`NO_ARGUMENTS_SCHEMA`; OpenAI's meaning of a function without parameters)."""
    if not parameters:
        return NO_ARGUMENTS_SCHEMA
    declares_nothing = parameters.get("type", "object") == "object" and not parameters.get("properties") \
        and not parameters.get("required") and set(parameters) <= _ANNOTATION_KEYS
    return NO_ARGUMENTS_SCHEMA if declares_nothing else parameters


def _check_tools(tools: object) -> tuple[dict, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidInputError(f"must be a list of at most {MAX_TOOLS} tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidInputError('must be {"type": "function", "function": {...}}', f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise InvalidInputError(f"must be a unique non-empty string, got {name!r}", f"tools[{i}].function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidInputError("must be a JSON schema object", f"tools[{i}].function.parameters")
    return tuple(tools)


def plan_tools(tools: object, tool_choice: object, parallel_tool_calls: bool | None,
               auto_parser: str | None) -> ToolPlan | None:
    """The plan for a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None when it has no tools
    and no choice other than ``none``.

    Args:
        auto_parser: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None.

    Raises:
        InvalidInputError: a malformed tool (``tools[i]...``); a tool_choice without tools, of an unknown form, naming
            a function not in ``tools``, or ``auto`` while the server has no parser (``tool_choice``).
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidInputError("needs `tools`", "tool_choice")
        return None
    checked = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if choice in ("none", "required"):
        return ToolPlan(checked, choice, parallel=parallel)
    if choice == "auto":
        if auto_parser is None:
            raise InvalidInputError(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan(checked, "auto", parallel=parallel, parser_name=auto_parser)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise InvalidInputError('must be "none", "auto", "required" or {"type": "function", "function": '
                                f'{{"name": ...}}}}, got {json.dumps(tool_choice)[:200]}', "tool_choice")
    if name not in {t["function"]["name"] for t in checked}:
        raise InvalidInputError(f"names function {name!r}, which is not in tools", "tool_choice")
    return ToolPlan(checked, "named", name=name, parallel=parallel)
