"""Exceptions the engine raises; the server's interceptor maps each to one gRPC status code.

Every client-caused error names the offending request field (``field``), so the status message does too.
"""
from __future__ import annotations


class PagedServeError(Exception):
    """Base class. ``field`` names the request field at fault, when there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class InvalidInputError(PagedServeError, ValueError):
    """Bad request content -> INVALID_ARGUMENT."""


class ContextLengthError(InvalidInputError):
    """The prompt, or the prompt and ``max_tokens``, past the model's context length -> INVALID_ARGUMENT (the HTTP
    API adds OpenAI's code :attr:`code`). The message is OpenAI's and vLLM's ("This model's maximum context length
    is N tokens. However, you requested M tokens (P in the prompt, C in the completion). ..."), which clients
    (LiteLLM's fallbacks) match.

    Args:
        max_model_len: the context length, in tokens.
        prompt_tokens: the prompt's length in tokens (a lower bound when ``at_least``).
        completion_tokens: the request's ``max_tokens``; None when unset (one token at least).
        field: the field at fault: the prompt's when it alone does not fit, else ``max_tokens``'.
        at_least: the prompt was refused from its size in bytes before tokenizing: ``prompt_tokens`` is the
            fewest tokens it can be.
    """

    code = "context_length_exceeded"

    def __init__(self, max_model_len: int, prompt_tokens: int, completion_tokens: int | None, field: str,
                 at_least: bool = False):
        self.max_model_len, self.prompt_tokens, self.completion_tokens = max_model_len, prompt_tokens, \
            completion_tokens
        self.at_least = at_least
        super().__init__(self.message_for("prompt"), field)

    def message_for(self, prompt_name: str) -> str:
        """The message, naming the prompt as the caller does (``prompt``, ``messages``)."""
        some = "at least " if self.at_least else ""
        head = f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
        if self.completion_tokens is None:
            return (f"{head}{some}{self.prompt_tokens} tokens in the {prompt_name}, which leaves no room for the "
                    f"completion. Please reduce the length of the {prompt_name}.")
        total = self.prompt_tokens + self.completion_tokens
        return (f"{head}{some}{total} tokens ({some}{self.prompt_tokens} in the {prompt_name}, "
                f"{self.completion_tokens} in the completion). Please reduce the length of the {prompt_name} or "
                "completion.")


class DuplicateRequestError(PagedServeError):
    """A live request already has this request_id -> ALREADY_EXISTS."""


class QueueFullError(PagedServeError):
    """The waiting queue is full -> RESOURCE_EXHAUSTED."""


class EngineUnavailableError(PagedServeError):
    """Shutting down, or the engine loop has died -> UNAVAILABLE."""


class ModelNotLoadedError(PagedServeError):
    """The RPC needs a model that is not loaded (Embed without an embedding model) -> FAILED_PRECONDITION."""


class DeadlineError(PagedServeError):
    """The request cannot finish before its deadline (or waited ``--max-queue-time-s``) and was refused before any
    prefill -> DEADLINE_EXCEEDED (HTTP 504). ``retry_after_s``: seconds after which a retry may find room (the
    ``google.rpc.RetryInfo`` detail, HTTP ``Retry-After``)."""

    def __init__(self, message: str, field: str | None = None, retry_after_s: float = 1.0):
        super().__init__(message, field)
        self.retry_after_s = retry_after_s
