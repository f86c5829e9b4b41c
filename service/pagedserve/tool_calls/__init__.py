"""Tool calling (OpenAI's ``tools`` / ``tool_choice``, vLLM's flags): the request plan and its output constraint
(:mod:`.request`), parsers of model output (:mod:`.parsers`), and streamed tool-call deltas (:mod:`.stream`).
Front-end neutral: the HTTP and gRPC front ends both use it."""
from .parsers import PARSERS, Snapshot, ToolParser, make_parser
from .request import ToolPlan, plan_tools
from .stream import ToolCallStream, call_dict, new_call_id, parse_whole

__all__ = ["PARSERS", "Snapshot", "ToolCallStream", "ToolParser", "ToolPlan", "call_dict", "make_parser",
           "new_call_id", "parse_whole", "plan_tools"]
