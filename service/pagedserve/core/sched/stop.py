"""Pure stop checks on a request after a token was appended (vLLM v1's ``check_stop``). Stop strings are the
output processor's (they need the text); everything decided on token ids is here."""
from __future__ import annotations

from ...request import Request, RequestStatus


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
