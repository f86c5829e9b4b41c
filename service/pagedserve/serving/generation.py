"""The generation model as the front ends see it: one engine call (:class:`GenerateCall`), and the model's
facts, tokenizer, bounds and admin calls (:class:`GenerationService`).

:class:`GenerationService` owns what no wire format should: the checks of a call's bounded fields, prompt
rendering off the event loop, Tokenize / Detokenize / Abort. Running calls is the request pipeline's
(:mod:`.pipeline`): request ids, request-scoped logging, request metrics, and turning a consumer that stops
reading (client disconnect, deadline, cancelled task) into an abort that frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..engine.async_engine import AsyncEngine
from ..engine.builder import EngineInfo
from ..engine.input_processor import check_context_length
from ..sampling_params import SamplingParams
from ..errors import InvalidInputError
from ..reasoning import get_parser
from ..text_bounds import min_num_tokens
from .metrics import ServerMetrics
from . import limits
from .prompts import ChatPrompt, Prompt, TextPrompt, render_prompt
from .request_metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One generation request, front-end neutral."""

    prompt: Prompt
    params: SamplingParams
    request_id: str | None = None      # None: a random one (uuid4 hex)
    priority: int = 0                  # lower runs first (vLLM's priority scheduling semantics)
    cache_salt: str | None = None      # isolates this request's prefix-cache entries
    deadline: float | None = None      # the call's deadline, time.monotonic() seconds (gRPC deadline, HTTP timeout)
    caller: str = ""                   # who sent it, for fair shares (serving/callers.py); "": not named


class GenerationService:
    """The generation engine behind both front ends.

    Args:
        engine: a started :class:`AsyncEngine`.
        info: what the engine was built with.
        metrics: the server's metrics; request metrics are recorded here.
        served_name: the metrics' ``model_name`` label (default: ``info.name``).
        chat_template: a Jinja template used for chat prompts instead of the model's (--chat-template).
        reasoning_parser: the --reasoning-parser name (None: off); ``reasoning`` is its parser.

    Raises:
        ValueError: an unknown reasoning parser name.
    """

    def __init__(self, engine: AsyncEngine, info: EngineInfo, metrics: ServerMetrics, served_name: str | None = None,
                 chat_template: str | None = None, reasoning_parser: str | None = None):
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.reasoning = get_parser(reasoning_parser) if reasoning_parser else None
        self.info = info
        self.chat_template = chat_template
        self.served_name = served_name or info.name   # the model name callers use (and the metrics' label)
        self.request_metrics = RequestMetrics(metrics, self.served_name)
        self.tokenizer = engine.tokenizer   # the model's transformers tokenizer

    @property
    def num_live_requests(self) -> int:
        """Requests the engine is running or has queued."""
        return self.engine.num_live_requests

    async def render(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenized off the event loop (tokenizers releases the GIL, so a multi-megabyte
        prompt does not stall other calls). Raises InvalidInputError naming the prompt's field."""
        return await asyncio.to_thread(render_prompt, prompt, self.tokenizer, self.chat_template)

    async def prepare(self, call: GenerateCall) -> list[int]:
        """Check the call's bounded fields and render its prompt. A text prompt that cannot fit ``max_model_len``
        (with ``max_tokens``) is refused from its length, before tokenizing (unless ``truncate_prompt_tokens``
        keeps only its end).

        Raises:
            ContextLengthError: a prompt that cannot fit (naming the prompt's field), or cannot fit with
                ``max_tokens`` (``sampling.max_tokens``).
            InvalidInputError: ``request_id`` / ``cache_salt`` over 256 characters or not printable, too many chat
                messages, or what rendering raises.
        """
        limits.check_identifier(call.request_id, "request_id")
        limits.check_identifier(call.cache_salt, "cache_salt")
        prompt = call.prompt
        if isinstance(prompt, ChatPrompt) and len(prompt.messages) > limits.MAX_CHAT_MESSAGES:
            raise InvalidInputError(f"at most {limits.MAX_CHAT_MESSAGES} messages, got {len(prompt.messages)}",
                                    prompt.field)
        if call.params.truncate_prompt_tokens is None and isinstance(prompt, (TextPrompt, ChatPrompt)):
            if isinstance(prompt, TextPrompt):
                size = len(prompt.text.encode("utf-8"))
            else:
                size = sum(len(str(m.get("content") or "").encode("utf-8")) for m in prompt.messages)
            check_context_length(min_num_tokens(size, self.tokenizer), call.params.max_tokens,
                                 self.info.max_model_len, prompt.field, at_least=True)
        return await self.render(prompt)

    async def tokenize(self, prompt: Prompt) -> tuple[list[int], list[str]]:
        """``(token ids, token strings)`` of a prompt (Tokenize API)."""
        ids = await self.render(prompt)
        return ids, self.tokenizer.convert_ids_to_tokens(ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True, field: str = "token_ids") -> str:
        """Text of ``token_ids``. Raises InvalidInputError (``field``) for an id outside the vocabulary."""
        vocab_size = self.engine.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", field)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort live requests; returns the ids that were live."""
        return await self.engine.abort(request_ids)

    def kv_cache_stats(self) -> dict:
        """The engine's KV cache and scheduler counters (``LLMEngine.stats()``)."""
        return self.engine.stats()

    async def shutdown(self) -> None:
        """Abort what is still live (those streams get their final "abort" delta) and stop the engine thread."""
        await self.engine.shutdown()

