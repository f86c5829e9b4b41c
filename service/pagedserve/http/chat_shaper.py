"""Chat completion responses and stream chunks (OpenAI's ``chat.completion`` / ``chat.completion.chunk``), with
tool calls: a choice's text goes through the request's tool parser (:mod:`pagedserve.tool_calls`), so the message
carries ``tool_calls`` and the stream sends their deltas; a choice that called tools and stopped finishes with
``"tool_calls"`` (one cut by ``max_tokens`` keeps ``"length"``). A streamed step that adds nothing to the
delta (text held back by the tool parser or an incomplete UTF-8 character) sends no chunk, except the one carrying
``finish_reason``."""
from __future__ import annotations

from ..outputs import CompletionDelta
from ..tool_calls import ToolCallStream, ToolPlan, parse_whole
from . import convert as cv


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


class ChatShaper:
    """Builds one request's chat responses or chunks; choice index = prompt index * n + completion index.

    Args:
        rid, model: the response id and model name.
        text: token id -> text (for logprobs).
        n: completions per prompt.
        logprobs: the request asked for logprobs.
        plan: the request's tools (None: none); with a parser, text is read for tool calls.
    """

    def __init__(self, rid: str, model: str, text: cv.TokenText, n: int, logprobs: bool, plan: ToolPlan | None):
        self.rid, self.model, self.text, self.n, self.logprobs = rid, model, text, n, logprobs
        self.plan = plan
        self.created = cv.now_s()
        self.usage = cv.UsageSum()
        self._started: set[int] = set()
        self._choices: dict[int, dict] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": cv.FINGERPRINT, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _delta(self, index: int, d: CompletionDelta) -> tuple[dict, bool]:
        """The chunk's ``delta`` for this engine delta, and whether the choice has called a tool so far."""
        if self.plan is None or self.plan.mode == "none":
            return ({"content": d.text} if d.text else {}), False
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = ToolCallStream(self.plan.parser(), self.plan.max_calls)
        content, calls = stream.feed(d.text, final=d.finish_reason is not None)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, stream.num_calls_started > 0

    def chunks(self, prompt_index: int, d: CompletionDelta) -> list[dict]:
        index = prompt_index * self.n + d.index
        out = []
        if index not in self._started:
            self._started.add(index)
            out.append(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        if d.usage is not None:
            self.usage.add(d.usage)
        if d.text or d.token_ids or d.finish_reason is not None:
            delta, called = self._delta(index, d)
            logprobs = self.logprobs and bool(d.logprobs)
            if not delta and not logprobs and d.finish_reason is None:
                return out  # as vLLM: a step whose text is held back (a tool call's start, partial UTF-8) sends nothing
            choice = {"index": index, "delta": delta,
                      "logprobs": {"content": cv.chat_logprobs(d.logprobs, self.text)} if logprobs else None,
                      "finish_reason": _finish(d.finish_reason, called)}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.matched_stop
            out.append(self._chunk([choice]))
        return out

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage.as_dict())

    def add(self, prompt_index: int, d: CompletionDelta) -> None:
        index = prompt_index * self.n + d.index
        c = self._choices.setdefault(index, {"index": index, "text": [], "lps": [], "finish": None, "stop": None})
        c["text"].append(d.text)
        c["lps"].extend(d.logprobs or [])
        if d.finish_reason is not None:
            c["finish"], c["stop"] = d.finish_reason, d.matched_stop
        if d.usage is not None:
            self.usage.add(d.usage)

    def _message(self, text: str) -> tuple[dict, bool]:
        parser = self.plan.parser() if self.plan is not None else None
        if parser is None:
            return {"role": "assistant", "content": text}, False
        content, calls = parse_whole(parser, text, self.plan.max_calls)
        return {"role": "assistant", "content": content, "tool_calls": calls}, bool(calls)

    def response(self) -> dict:
        choices = []
        for _, c in sorted(self._choices.items()):
            message, called = self._message("".join(c["text"]))
            choices.append({"index": c["index"], "message": message,
                            "logprobs": {"content": cv.chat_logprobs(c["lps"], self.text)} if self.logprobs else None,
                            "finish_reason": _finish(c["finish"], called), "stop_reason": c["stop"]})
        return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": choices, "usage": self.usage.as_dict()}
