"""Checks a request against the model before it is queued (vLLM's ``Processor``): prompt length and token ids,
``max_tokens`` room, the sampling parameters' model-dependent limits. Errors name the request field."""
from __future__ import annotations

from ..errors import InvalidInputError
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
            InvalidInputError: empty prompt, unknown token id, prompt or max_tokens past max_model_len, or a
                sampling parameter past the model's limits.
        """
        params.validate_for_model(self.vocab_size, self.max_logprobs)
        ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else []
        self.check_prompt(ids, self.max_model_len - 1, "prompt")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidInputError(f"max_tokens {params.max_tokens} exceeds the {room} tokens left after the "
                                    f"{len(ids)}-token prompt (max_model_len {self.max_model_len})",
                                    "sampling.max_tokens")
        return ids, params.max_tokens or room

    def check_prompt(self, ids: list[int], max_len: int, field: str) -> None:
        """Raises InvalidInputError (naming ``field``, or ``prompt_token_ids`` for a bad id in a prompt) when
        ``ids`` is empty, holds an id outside the vocabulary, or is longer than ``max_len``."""
        if not ids:
            raise InvalidInputError("the prompt is empty" if field == "prompt" else "has no tokens", field)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                    "prompt_token_ids" if field == "prompt" else field)
        if len(ids) > max_len:
            hint = "so at most max_model_len - 1 prompt tokens fit" if field == "prompt" else "set truncate"
            subject = "the prompt has" if field == "prompt" else "has"
            raise InvalidInputError(f"{subject} {len(ids)} tokens; max_model_len is {self.max_model_len}, {hint}",
                                    field)
