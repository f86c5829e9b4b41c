"""Tool calling in the request pipeline, for both APIs: a :class:`~pagedserve.tool_calls.ToolPlan` applied to an
engine call (tools shown to the chat template, the output held to the plan's schema), each choice's streamed text
read for tool calls, a finished choice's text read whole, and the finish reason of a choice that called tools."""
from __future__ import annotations

import dataclasses

from ..errors import InvalidInputError
from ..sampling_params import STRUCTURED_OUTPUT_FIELD, StructuredOutput
from ..tool_calls import ToolCallStream, ToolPlan, parse_whole
from .caller_errors import FieldNames
from .generation import GenerateCall
from .prompts import ChatPrompt


def apply_tools(call: GenerateCall, plan: ToolPlan | None, fields: FieldNames) -> GenerateCall:
    """``call`` with the plan's tools shown to the chat template and, for a required or named tool choice, its
    output held to the plan's schema.

    Raises:
        InvalidInputError: the plan constrains the output and the call has a structured-output constraint too
            (``tool_choice``; the message names the constraint's field as ``fields`` spell it).
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
                                    f"{fields.caller_field(STRUCTURED_OUTPUT_FIELD)}", "tool_choice")
        params = dataclasses.replace(params, structured_output=StructuredOutput(json_schema=plan.schema))
    return dataclasses.replace(call, prompt=prompt, params=params)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice's finish reason: ``"tool_calls"`` for one that called tools and stopped (one cut by max_tokens
    keeps ``"length"``)."""
    return "tool_calls" if called and reason == "stop" else reason


def reads_tools(plan: ToolPlan | None) -> bool:
    """Whether the plan's choices are read for tool calls (any plan but none, or ``tool_choice: none``)."""
    return plan is not None and plan.mode != "none"


class StreamedToolCalls:
    """Each choice's streamed text through a fresh parser of the plan (:class:`~pagedserve.tool_calls.
    ToolCallStream`): content to show and tool-call pieces to send, choice by choice."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._streams: dict[int, ToolCallStream] = {}

    def feed(self, index: int, text: str, final: bool) -> tuple[str, list[dict], bool]:
        """``(new content, new tool-call pieces, whether the choice has called a tool so far)`` for choice
        ``index``'s next ``text``; ``final`` on its last delta."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolCallStream(self.plan.parser(), self.plan.max_calls)
        content, calls = stream.feed(text, final=final)
        return content, calls, stream.num_calls_started > 0


def whole_message(plan: ToolPlan | None, text: str) -> tuple[str | None, list[dict] | None]:
    """A finished choice's ``(content, tool_calls)``: ``tool_calls`` None when the plan reads none (the text is
    the content), else the calls found (content None when empty)."""
    parser = plan.parser() if plan is not None else None
    if parser is None:
        return text, None
    return parse_whole(parser, text, plan.max_calls)
