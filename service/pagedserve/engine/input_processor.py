"""Checks a request against the model before it is queued (vLLM's ``Processor``): prompt length and token ids,
``max_tokens`` room, the sampling parameters' model-dependent limits. Errors name the request field."""
from __future__ import annotations

from ..errors import ContextLengthError, InvalidInputError
from ..sampling_params import SamplingParams


class InputProcessor:
    """Args: vocab_size (token ids must be below it), max_model_len (context length at most), max_logprobs (the
    server's cap on ``logprobs`` / ``prompt_logprobs``)."""

    def __init__(self, vocab_size: int, max_model_len: int, max_logprobs: int):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs

    def generation(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], int]:
        """The prompt after ``truncate_prompt_tokens`` and the request's resolved ``max_tokens`` (the room left
        in max_model_len when unset).

        Raises:
            ContextLengthError: the prompt leaves no room for one token (field ``prompt``), or the prompt and
                max_tokens do not fit in max_model_len (``sampling.max_tokens``).
            InvalidInputError: empty prompt, unknown token id, or a sampling parameter past the model's limits.
        """
        params.validate_for_model(self.vocab_size, self.max_logprobs)
        ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else []
        self.check_ids(ids, "prompt")
        check_context_length(len(ids), params.max_tokens, self.max_model_len, "prompt")
        return ids, params.max_tokens or self.max_model_len - len(ids)

    def check_ids(self, ids: list[int], field: str) -> None:
        """Raises InvalidInputError (naming ``field``, or ``prompt_token_ids`` for a bad id in a prompt) when
        ``ids`` is empty or holds an id outside the vocabulary."""
        if not ids:
            raise InvalidInputError("the prompt is empty" if field == "prompt" else "has no tokens", field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                    "prompt_token_ids" if field == "prompt" else field)

    def check_prompt(self, ids: list[int], max_len: int, field: str) -> None:
        """:meth:`check_ids`, and InvalidInputError (naming ``field``) when ``ids`` is longer than ``max_len`` (an
        input to embed)."""
        self.check_ids(ids, field)
        if len(ids) > max_len:
            raise InvalidInputError(f"has {len(ids)} tokens; max_model_len is {self.max_model_len}, set truncate",
                                    field)


def check_context_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_field: str,
                         at_least: bool = False) -> None:
    """Raises ContextLengthError when a prompt of ``prompt_tokens`` tokens (at least that many, ``at_least``)
    leaves no room for one new token (naming ``prompt_field``), or with ``max_tokens`` (None: unset) does not fit
    in ``max_model_len`` (naming ``sampling.max_tokens``)."""
    if prompt_tokens >= max_model_len:
        raise ContextLengthError(max_model_len, prompt_tokens, max_tokens, prompt_field, at_least)
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(max_model_len, prompt_tokens, max_tokens, "sampling.max_tokens", at_least)
