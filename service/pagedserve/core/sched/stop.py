"""How a request ends: pure stop checks on token ids after a token was appended (vLLM v1's ``check_stop``), and
stop strings on the detokenized text (:class:`OutputText`). The scheduler's ``update_from_output`` calls both."""
from __future__ import annotations

import time

from ...request import Request, RequestStatus
from ..detokenizer import IncrementalDetokenizer
from .output import RequestUpdate


def is_stop_token(request: Request, token_id: int) -> bool:
    """Whether ``token_id``, just appended, ends ``request``: one of ``stop_token_ids``, or an EOS id unless
    ``ignore_eos``, once more than ``min_tokens`` tokens exist (the sampler masks them before that)."""
    params = request.params
    if request.num_output_tokens <= params.min_tokens:
        return False
    return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids)


def check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """How ``request`` ends after ``token_id`` was appended (its grammar, if any, already advanced past a token
    that is not a stop token): ``(FINISHED_STOPPED, token_id)`` for a stop token, ``(FINISHED_STOPPED, None)`` when
    its grammar is complete, ``(FINISHED_LENGTH, None)`` at ``max_tokens`` or ``max_model_len``; None: it goes on."""
    if is_stop_token(request, token_id):
        return RequestStatus.FINISHED_STOPPED, token_id
    if request.grammar is not None and request.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED, None
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


class OutputText:
    """Each completion's incremental detokenizer (:class:`pagedserve.core.detokenizer.IncrementalDetokenizer`):
    the text of the tokens a step appended, and the stop strings found in it, which end the completion at the token
    that completed the match (tokens a verified run appended after it are taken back: they were never shown).

    Args:
        tokenizer: the model's transformers tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._detok: dict[Request, IncrementalDetokenizer] = {}

    def add(self, request: Request) -> None:
        """Detokenize ``request``'s output from now on (generation requests; not pooling or beam search)."""
        self._detok[request] = IncrementalDetokenizer(self.tokenizer, request.params, request.prompt_token_ids)

    def push(self, update: RequestUpdate, finish) -> None:
        """Feed ``update``'s new tokens (a stop token's text only with include_stop_str_in_output) to its
        detokenizer, appending to ``update.text``; on a stop string the tokens after the one that completed it
        leave ``update`` and the request, and ``finish(request, FINISHED_STOPPED)`` ends it (a request that ended
        on its length this step is stopped by the string instead). A traced request (``request.timings``) adds
        the time this took to its ``detokenize_s``."""
        timings = update.request.timings
        if timings is None:
            return self._push(update, finish)
        start = time.monotonic()
        self._push(update, finish)
        timings.detokenize_s += time.monotonic() - start

    def _push(self, update: RequestUpdate, finish) -> None:
        req = update.request
        detok = self._detok.get(req)
        if detok is None:
            return
        tokens = update.new_token_ids
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            if last and update.stopped_by_token and not req.params.include_stop_str_in_output:
                break
            text = detok.add_tokens([token])
            update.text += text.text
            if text.stop_str is None or (last and update.stopped_by_token):
                continue
            extra = len(tokens) - 1 - j      # tokens appended after the stop string: never shown
            if extra:
                del req.token_ids[-extra:], tokens[-extra:], update.new_logprobs[-extra:]
            if not req.is_finished:
                finish(req, RequestStatus.FINISHED_STOPPED)
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, text.stop_str
            return

    def finish(self, request: Request, flush: bool = True) -> str:
        """Forget an ended request's detokenizer; returns the held-back tail of its text (``flush`` and not ended by
        a stop string; else ""). A tail that completes a stop string makes the request stopped by it."""
        detok = self._detok.pop(request, None)
        if detok is None or not flush or isinstance(request.stop_reason, str):
            return ""
        text = detok.flush()
        if detok.matched_stop is not None and request.stop_reason is None:  # the held-back tail completed a stop
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detok.matched_stop
        return text
