"""Tool calling over gRPC: ``GenerateRequest.tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a
:class:`~pagedserve.tool_calls.ToolPlan` (the same plan and checks as the HTTP API). The request pipeline
(:mod:`pagedserve.serving.pipeline`) applies it and reads the output for calls."""
from __future__ import annotations

import json

from pagedserve_client.v1 import inference_pb2 as pb

from ..errors import InvalidInputError
from ..tool_calls import ToolPlan, plan_tools

_MODES = {pb.TOOL_CHOICE_MODE_NONE: "none", pb.TOOL_CHOICE_MODE_AUTO: "auto",
          pb.TOOL_CHOICE_MODE_REQUIRED: "required"}


def _tool_dict(tool: pb.Tool, i: int) -> dict:
    fn: dict = {"name": tool.name, "description": tool.description}
    if tool.parameters_json:
        try:
            fn["parameters"] = json.loads(tool.parameters_json)
        except ValueError:
            raise InvalidInputError("must be JSON text", f"tools[{i}].parameters_json") from None
    return {"type": "function", "function": fn}


def _choice(req: pb.GenerateRequest) -> str | dict | None:
    if not req.HasField("tool_choice"):
        return None
    which = req.tool_choice.WhichOneof("choice")
    if which == "function_name":
        return {"type": "function", "function": {"name": req.tool_choice.function_name}}
    if which == "mode" and req.tool_choice.mode in _MODES:
        return _MODES[req.tool_choice.mode]
    raise InvalidInputError("set mode (NONE, AUTO, REQUIRED) or function_name", "tool_choice")


def tool_plan_from_proto(req: pb.GenerateRequest, auto_parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None without tools). Raises InvalidInputError naming the field (``tools[i]...``,
    ``tool_choice``), as :func:`pagedserve.tool_calls.plan_tools` does."""
    tools = [_tool_dict(t, i) for i, t in enumerate(req.tools)]
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
    return plan_tools(tools, _choice(req), parallel, auto_parser)
