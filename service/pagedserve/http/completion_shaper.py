"""Text completion responses and stream chunks (OpenAI's ``text_completion``), with ``echo`` (the prompt's text,
and its logprobs, before the completion's) and vLLM's scoring path (``echo`` with ``max_tokens: 0``)."""
from __future__ import annotations

from ..outputs import CompletionDelta
from ..serving.pipeline import ChoiceDelta, UsageTotal
from . import convert as cv


class CompletionShaper:
    """Text completion responses and chunks; ``echo`` (per prompt) prepends each prompt's text; ``prompt_only``
    (echo with max_tokens 0) drops the one token the engine sampled: text, logprobs and usage show the prompt
    alone."""

    def __init__(self, rid: str, model: str, text: cv.TokenText, logprobs: bool,
                 echo: list[tuple[str, list[int]]] | None, prompt_only: bool = False):
        self.rid, self.model, self.text, self.logprobs = rid, model, text, logprobs
        self.echo = echo                   # per prompt: (its text, its token ids), when echo was asked for
        self.prompt_only = prompt_only
        self.created = cv.now_s()
        self._seen: set[int] = set()
        self._lps: dict[int, cv.CompletionLogprobs] = {}
        self._prompt_lps: dict[int, list] = {}
        self._choices: dict[int, dict] = {}

    def _choice_lps(self, c: ChoiceDelta) -> tuple[str, cv.CompletionLogprobs | None]:
        """(echoed prompt text or "", the choice's logprobs builder) for this delta."""
        index, prompt_index, d = c.index, c.prompt_index, c.delta
        if d.prompt_logprobs:  # on the request's first delta
            self._prompt_lps[prompt_index] = d.prompt_logprobs
        lps = self._lps.setdefault(index, cv.CompletionLogprobs(self.text)) if self.logprobs else None
        prefix = ""
        if index not in self._seen:
            self._seen.add(index)
            if self.echo is not None:
                prefix, ids = self.echo[prompt_index]
                if lps is not None:  # the first prompt token has no logprob
                    by_pos = dict(enumerate(self._prompt_lps.get(prompt_index, []), start=1))
                    for pos, tid in enumerate(ids):
                        lp = by_pos.get(pos)
                        lps.add_token(tid, None if lp is None else lp.logprob, None if lp is None else lp.top)
        if lps is not None and not self.prompt_only:
            lps.add(d.logprobs or [])
        return prefix, lps

    def _text_of(self, prefix: str, d: CompletionDelta) -> str:
        return prefix if self.prompt_only else prefix + d.text

    def usage(self, total: UsageTotal) -> dict:
        """OpenAI's ``usage`` of the request so far (the prompt alone when ``prompt_only``)."""
        return cv.usage_dict(total, self.prompt_only)

    def chunks(self, c: ChoiceDelta) -> list[dict]:
        prefix, lps = self._choice_lps(c)
        d = c.delta
        choice = {"index": c.index, "text": self._text_of(prefix, d),
                  "logprobs": lps.take() if lps is not None else None, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = d.matched_stop
        return [{"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                 "system_fingerprint": cv.FINGERPRINT, "choices": [choice]}]

    def usage_chunk(self, usage: dict) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": [], "usage": usage}

    def add(self, c: ChoiceDelta) -> None:
        prefix, _ = self._choice_lps(c)
        d = c.delta
        choice = self._choices.setdefault(c.index, {"index": c.index, "text": [], "finish": None, "stop": None})
        choice["text"].append(self._text_of(prefix, d))
        if d.finish_reason is not None:
            choice["finish"], choice["stop"] = d.finish_reason, d.matched_stop

    def response(self, usage: dict) -> dict:
        choices = [{"index": i, "text": "".join(c["text"]),
                    "logprobs": self._lps[i].as_dict() if self.logprobs else None,
                    "finish_reason": c["finish"], "stop_reason": c["stop"]}
                   for i, c in sorted(self._choices.items())]
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": cv.FINGERPRINT, "choices": choices, "usage": usage}
