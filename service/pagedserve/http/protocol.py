"""Request bodies of the OpenAI-compatible API (OpenAI's field names and types), with vLLM's extra sampling fields.

Unknown fields are accepted and ignored (OpenAI clients add new ones over time), except those naming capabilities
this server does not have (:data:`UNSUPPORTED_FIELDS`), which are a 400 naming the field rather than a silent
acceptance. Ranges are checked by the engine's :class:`~pagedserve.sampling_params.SamplingParams`, so both
APIs give the same answer for the same value.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..sampling_params import SamplingParams

# Fields of OpenAI's chat/completions bodies that ask for what this server does not do.
UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
                      "suffix")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False          # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


# SamplingParams fields a body carries under another name or shape (set by ``convert.sampling_params`` from
# ``max_tokens`` / ``max_completion_tokens``, ``logprobs`` / ``top_logprobs`` / ``echo``, ``response_format`` and
# the other constraint fields, ``use_beam_search``).
SAMPLING_SHAPED_FIELDS = ("max_tokens", "logprobs", "prompt_logprobs", "structured_output", "beam_search")
# How a body spells the SamplingParams fields whose JSON type differs from the engine's (OpenAI's types).
_WIRE_TYPES = {"stop": str | list[str] | None, "stop_token_ids": list[int] | None,
               "logit_bias": dict[str, float] | None}


def _sampling_fields() -> dict:
    """pydantic field definitions of every SamplingParams field a body carries as is, optional (None: the
    engine's default), typed from the dataclass's annotations; the one list of sampling fields is the dataclass."""
    hints = typing.get_type_hints(SamplingParams)
    return {f.name: (_WIRE_TYPES.get(f.name, hints[f.name] | None), None)
            for f in dataclasses.fields(SamplingParams) if f.name not in SAMPLING_SHAPED_FIELDS}


_SamplingFields = create_model("_SamplingFields", __base__=_Body, **_sampling_fields())
SAMPLING_BODY_FIELDS = tuple(_SamplingFields.model_fields)
"""The SamplingParams fields both bodies carry under their own name (every field but the shaped ones)."""


class _SamplingBody(_SamplingFields):
    """Sampling fields shared by chat and completions: SamplingParams' (OpenAI's and vLLM's names are the
    engine's), then the request options."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None              # accepted, ignored
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None        # vLLM: the engine request id (default: random)
    timeout: float | None = Field(None, gt=0)  # seconds from arrival the call may take (its deadline; HTTP 504
                                         # with Retry-After when it cannot finish in time: core/sched/deadlines.py)
    best_of: int | None = None           # OpenAI: 1 (the default) only; this server does not rank candidates
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:<id>"
    use_beam_search: bool = False        # vLLM: beam search with beam width n; n completions in score order
    length_penalty: float | None = None  # vLLM (beam search): HF's length_penalty, default 1.0
    early_stopping: bool | None = None   # vLLM (beam search): HF's early_stopping, default false
    # Structured output, one of: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_*.
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs: dict | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None      # tool: the call this message answers


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True   # vLLM extra
    tools: list[dict] | None = None      # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # vLLM: more chat template variables, e.g. {"enable_thinking": false}
    include_reasoning: bool = True       # vLLM: false leaves reasoning_content out (--reasoning-parser)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16          # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM: -1 or k keeps the first tokens (any k truncates here)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None  # vLLM: more chat template variables (messages)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
