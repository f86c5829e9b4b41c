"""The generation model as the front ends see it: prompt in, stream of completion deltas out.

:class:`GenerationService` owns what no wire format should: request ids, prompt rendering off the event loop,
request-scoped logging, request metrics (:mod:`.request_metrics`), and turning a consumer that stops reading
(client disconnect, deadline, cancelled task) into an abort that frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from ..engine.async_engine import AsyncEngine
from ..engine.builder import EngineInfo
from ..outputs import CompletionDelta
from ..sampling_params import SamplingParams
from ..errors import InvalidInputError
from ..text_bounds import check_text_can_fit
from .metrics import ServerMetrics
from . import limits
from .prompts import ChatPrompt, Prompt, TextPrompt, render_prompt
from .request_metrics import MeteredEngine

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One generation request, front-end neutral."""

    prompt: Prompt
    params: SamplingParams
    request_id: str | None = None      # None: a random one (uuid4 hex)
    priority: int = 0                  # lower runs first (vLLM's priority scheduling semantics)
    cache_salt: str | None = None      # isolates this request's prefix-cache entries


class GenerationService:
    """The generation engine behind both front ends.

    Args:
        engine: a started :class:`AsyncEngine`.
        info: what the engine was built with.
        metrics: the server's metrics; request metrics are recorded here.
        served_name: the metrics' ``model_name`` label (default: ``info.name``).
        chat_template: a Jinja template used for chat prompts instead of the model's (--chat-template).
    """

    def __init__(self, engine: AsyncEngine, info: EngineInfo, metrics: ServerMetrics, served_name: str | None = None,
                 chat_template: str | None = None):
        self.engine = engine
        self.info = info
        self.chat_template = chat_template
        self._metered = MeteredEngine(engine, metrics, served_name or info.name)

    @property
    def tokenizer(self):
        """The model's transformers tokenizer."""
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_live_requests(self) -> int:
        return self.engine.num_live_requests

    async def render(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, tokenized off the event loop (tokenizers releases the GIL, so a multi-megabyte
        prompt does not stall other calls). Raises InvalidInputError naming the prompt's field."""
        return await asyncio.to_thread(render_prompt, prompt, self.tokenizer, self.chat_template)

    async def prepare(self, call: GenerateCall) -> list[int]:
        """Check the call's bounded fields and render its prompt. A text prompt that cannot fit ``max_model_len``
        is refused from its length, before tokenizing (unless ``truncate_prompt_tokens`` keeps only its end).

        Raises:
            InvalidInputError: ``request_id`` / ``cache_salt`` over 256 characters or not printable, too many chat
                messages, a prompt that cannot fit (naming the prompt's field), or what rendering raises.
        """
        limits.check_identifier(call.request_id, "request_id")
        limits.check_identifier(call.cache_salt, "cache_salt")
        prompt = call.prompt
        if isinstance(prompt, ChatPrompt) and len(prompt.messages) > limits.MAX_CHAT_MESSAGES:
            raise InvalidInputError(f"at most {limits.MAX_CHAT_MESSAGES} messages, got {len(prompt.messages)}",
                                    prompt.field)
        if call.params.truncate_prompt_tokens is None:
            room = self.info.max_model_len - 1
            if isinstance(prompt, TextPrompt):
                check_text_can_fit(len(prompt.text.encode("utf-8")), room, self.tokenizer, prompt.field)
            elif isinstance(prompt, ChatPrompt):
                size = sum(len(str(m.get("content") or "").encode("utf-8")) for m in prompt.messages)
                check_text_can_fit(size, room, self.tokenizer, prompt.field)
        return await self.render(prompt)

    async def generate(self, call: GenerateCall, prompt_ids: list[int] | None = None
                       ) -> AsyncIterator[CompletionDelta]:
        """Run ``call`` and yield its deltas until every completion has finished (``params.n`` of them; the last
        delta carries the usage). ``prompt_ids`` skips :meth:`prepare` when the caller prepared the call already.
        Leaving the iterator early aborts the request.

        Raises (before the first delta unless said):
            InvalidInputError: bad prompt or sampling values for this model (naming the field).
            DuplicateRequestError, QueueFullError: from admission.
            EngineUnavailableError: shutting down or the engine died (also mid-stream).
        """
        if prompt_ids is None:
            prompt_ids = await self.prepare(call)
        request_id = call.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            ids = prompt_ids
            params = call.params
            log.info("generate_start", prompt_tokens=len(ids), max_tokens=params.max_tokens, n=params.n)
            num_tokens, open_completions = 0, params.n
            try:
                async for delta in self._metered.generate(request_id, ids, params, call.priority, call.cache_salt):
                    num_tokens += len(delta.token_ids)
                    if delta.finish_reason is not None:
                        open_completions -= 1
                        log.info("completion_finished", index=delta.index, finish_reason=delta.finish_reason,
                                 completion_tokens=num_tokens)
                    yield delta
            finally:
                if open_completions > 0:  # the consumer left (cancel, deadline, disconnect) or the request failed
                    log.info("generate_cancelled", open_completions=open_completions, completion_tokens=num_tokens)

    async def tokenize(self, prompt: Prompt) -> tuple[list[int], list[str]]:
        """``(token ids, token strings)`` of a prompt (Tokenize API)."""
        ids = await self.render(prompt)
        return ids, self.tokenizer.convert_ids_to_tokens(ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True, field: str = "token_ids") -> str:
        """Text of ``token_ids``. Raises InvalidInputError (``field``) for an id outside the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", field)
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

