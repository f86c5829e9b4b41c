"""Tool calling over gRPC: ``GenerateRequest.tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a
:class:`~pagedserve.tool_calls.ToolPlan` (the same plan and checks as the HTTP API), and each completion's deltas
-> content ``text`` plus ``tool_calls`` pieces (:class:`~pagedserve.tool_calls.ToolCallStream`)."""
from __future__ import annotations

import dataclasses
import json

from pagedserve_client.v1 import inference_pb2 as pb

from ..outputs import CompletionDelta
from ..sampling_params import StructuredOutput
from ..errors import InvalidInputError
from ..serving.generation import GenerateCall
from ..serving.prompts import ChatPrompt
from ..tool_calls import ToolCallStream, ToolPlan, plan_tools

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


def with_tools(call: GenerateCall, plan: ToolPlan | None) -> GenerateCall:
    """``call`` with the plan's tools shown to the chat template and its output constraint (required / named).

    Raises:
        InvalidInputError: the plan constrains the output and sampling.structured_output is set too
            (``tool_choice``).
    """
    if plan is None:
        return call
    prompt = call.prompt
    if isinstance(prompt, ChatPrompt):
        prompt = dataclasses.replace(prompt, tools=plan.tools)
    params = call.params
    if plan.schema is not None:
        if params.structured_output is not None:
            raise InvalidInputError("a required or named tool choice cannot be combined with "
                                    "sampling.structured_output", "tool_choice")
        params = dataclasses.replace(params, structured_output=StructuredOutput(json_schema=plan.schema))
    return dataclasses.replace(call, prompt=prompt, params=params)


class ToolDeltas:
    """Rewrites each completion's responses: ``text`` keeps the content, tool calls go to ``tool_calls``, and a
    completion that called tools and stopped finishes with FINISH_REASON_TOOL_CALLS."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._streams: dict[int, ToolCallStream] = {}

    def apply(self, d: CompletionDelta, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        stream = self._streams.get(d.index)
        if stream is None:
            stream = self._streams[d.index] = ToolCallStream(self.plan.parser(), self.plan.max_calls)
        content, calls = stream.feed(d.text, final=d.finish_reason is not None)
        msg.text = content
        for c in calls:
            fn = c["function"]
            msg.tool_calls.add(index=c["index"], id=c.get("id", ""), name=fn.get("name", ""),
                               arguments=fn.get("arguments", ""))
        if d.finish_reason == "stop" and stream.num_calls_started:
            msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        return msg
