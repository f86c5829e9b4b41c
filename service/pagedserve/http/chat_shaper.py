"""Chat completion responses and stream chunks (OpenAI's ``chat.completion`` / ``chat.completion.chunk``), with
tool calls: a choice's text is read for calls by the request pipeline (:mod:`pagedserve.serving.tools`), so the
message carries ``tool_calls`` and the stream sends their deltas; a choice that called tools and stopped finishes
with ``"tool_calls"`` (one cut by ``max_tokens`` keeps ``"length"``). A streamed step that adds nothing to the
delta (text held back by the tool or reasoning parser, or an incomplete UTF-8 character) sends no chunk, except
the one carrying ``finish_reason``.

With ``--reasoning-parser``: the message's ``reasoning_content`` and ``reasoning`` (vLLM's older and newer names,
the same text; null when the choice produced none; ``content`` null when it ended inside its reasoning) and the
stream's ``delta.reasoning_content`` / ``delta.reasoning``; the content and its tool calls are the text after the
reasoning. ``usage`` then has ``completion_tokens_details.reasoning_tokens`` (OpenAI's name)."""
from __future__ import annotations

from ..serving.pipeline import ChoiceDelta, UsageTotal
from ..serving.tools import finish_reason, whole_message
from ..tool_calls import ToolPlan
from . import convert as cv


class ChatShaper:
    """Builds one request's chat responses or chunks from the pipeline's deltas.

    Args:
        rid, model: the response id and model name.
        text: token id -> text (for logprobs).
        logprobs: the request asked for logprobs.
        plan: the request's tools (None: none); a whole response reads the text for tool calls here (a stream's
            deltas come read by the pipeline).
        reasoning: the responses carry the reasoning fields (a reasoning parser, and ``include_reasoning``).
        reasoning_usage: ``usage`` carries the reasoning token count (a reasoning parser).
    """

    def __init__(self, rid: str, model: str, text: cv.TokenText, logprobs: bool, plan: ToolPlan | None,
                 reasoning: bool = False, reasoning_usage: bool = False):
        self.rid, self.model, self.text, self.logprobs = rid, model, text, logprobs
        self.plan = plan
        self.reasoning, self.reasoning_usage = reasoning, reasoning_usage
        self.created = cv.now_s()
        self._started: set[int] = set()
        self._choices: dict[int, dict] = {}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": cv.FINGERPRINT, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(self, total: UsageTotal) -> dict:
        """OpenAI's ``usage`` of the request so far."""
        return cv.usage_dict(total, reasoning=self.reasoning_usage)

    def chunks(self, c: ChoiceDelta) -> list[dict]:
        d = c.delta
        out = []
        if c.index not in self._started:
            self._started.add(c.index)
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        if d.text or d.token_ids or d.finish_reason is not None:
            delta: dict = {"content": c.content} if c.content else {}
            if self.reasoning and c.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = c.reasoning
            if c.tool_calls:
                delta["tool_calls"] = c.tool_calls
            logprobs = self.logprobs and bool(d.logprobs)
            if not delta and not logprobs and d.finish_reason is None:
                return out  # as vLLM: a step whose text is held back (a tool call's start, partial UTF-8) sends nothing
            choice = {"index": c.index, "delta": delta,
                      "logprobs": {"content": cv.chat_logprobs(d.logprobs, self.text)} if logprobs else None,
                      "finish_reason": c.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.matched_stop
            out.append(self._chunk([choice]))
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self._chunk([], usage)

    def add(self, c: ChoiceDelta) -> None:
        d = c.delta
        choice = self._choices.setdefault(c.index, {"index": c.index, "text": [], "lps": [], "finish": None,
                                                    "stop": None, "reasoning": None})
        choice["text"].append(c.content)
        if c.reasoning is not None:
            choice["reasoning"] = (choice["reasoning"] or "") + c.reasoning
        choice["lps"].extend(d.logprobs or [])
        if d.finish_reason is not None:
            choice["finish"], choice["stop"] = d.finish_reason, d.matched_stop

    def response(self, usage: dict) -> dict:
        choices = []
        for _, c in sorted(self._choices.items()):
            content, calls = whole_message(self.plan, "".join(c["text"]))
            if self.reasoning_usage and c["reasoning"] is not None and not content:
                content = None   # as vLLM: a choice cut inside its reasoning has no content
            message = {"role": "assistant", "content": content}
            if self.reasoning:
                message["reasoning_content"] = message["reasoning"] = c["reasoning"]
            if calls is not None:
                message["tool_calls"] = calls
            choices.append({"index": c["index"], "message": message,
                            "logprobs": {"content": cv.chat_logprobs(c["lps"], self.text)} if self.logprobs else None,
                            "finish_reason": finish_reason(c["finish"], bool(calls)), "stop_reason": c["stop"]})
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": choices, "usage": usage}
