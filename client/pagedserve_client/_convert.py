"""Plain Python values to pagedserve.v1 request messages, shared by the sync and the asyncio client.

Every builder leaves a field with presence unset when its argument is None, so the server applies the default
that API.md gives; an explicit 0 / False / 0.0 is sent as such.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Union

from .v1 import inference_pb2 as pb

SERVICE_NAME = "pagedserve.v1.InferenceService"
HEALTH_SERVICE_NAME = "grpc.health.v1.Health"
DEFAULT_TARGET = "127.0.0.1:50051"
# Unary RPCs are retried on UNAVAILABLE; Generate (server streaming) and EmbedStream (bidi) never are.
RETRIED_METHODS = ("Embed", "Tokenize", "Detokenize", "GetModelInfo", "Abort")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# One chat turn: ("user", "hi"), {"role": "user", "content": "hi"} or a ChatMessage.
Message = Union[tuple[str, str], Mapping[str, str], pb.ChatMessage]


class GenerationResult(NamedTuple):
    """The outcome of one completion, as generate_text() returns it."""

    text: str  # the whole completion text (deltas joined)
    finish_reason: str  # FinishReason name without prefix: "STOP", "LENGTH" or "ABORT"
    usage: pb.Usage  # prompt_tokens, completion_tokens, cached_prompt_tokens (and reasoning_tokens) of the request
    reasoning_text: str = ""  # with the server's --reasoning-parser: the thinking (text is then the answer only)


API_KEY_ENV = "PAGEDSERVE_API_KEY"


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """``authorization: Bearer <key>`` call metadata for ``api_key`` (default: $PAGEDSERVE_API_KEY), None for none."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {key}"),) if key else None


def call_metadata(base: tuple[tuple[str, str], ...] | None,
                  extra: Iterable[tuple[str, str]] | None) -> tuple[tuple[str, str], ...] | None:
    """The client's own metadata (``base``: the API key) and one call's ``extra`` pairs, e.g. W3C
    ``("traceparent", "00-<trace id>-<span id>-01")`` to continue the caller's trace; None when both are empty.
    Raises ValueError for a key that is not a lower-case string (gRPC's rule for metadata keys) or a value that is
    not a string."""
    pairs = list(extra or ())
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"metadata: want (key, value) pairs, got {pair!r}")
        key, value = pair
        if not isinstance(key, str) or not key or key != key.lower():
            raise ValueError(f"metadata: keys are non-empty lower-case strings, got {key!r}")
        if not isinstance(value, str):
            raise ValueError(f"metadata: the value of {key!r} must be a string, got {type(value).__name__}")
    merged = tuple(base or ()) + tuple(pairs)
    return merged or None


def tls_credentials(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None):
    """grpc.ChannelCredentials for a TLS server: ``ca_file`` (PEM) to verify it (default: the system roots), and
    ``cert_file`` + ``key_file`` for a client certificate (mutual TLS). Raises OSError for an unreadable file,
    ValueError when only one of cert_file / key_file is given."""
    import grpc

    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def service_config_json(max_attempts: int = 4, round_robin: bool = False) -> str:
    """gRPC service config (JSON): retry the unary methods on UNAVAILABLE with exponential backoff; with
    ``round_robin``, spread calls over every resolved address (see :mod:`pagedserve_client.targets`).

    Backoff per gRFC A6: the n-th retry waits a random time in [0, min(0.1 s * 2**(n-1), 2 s)].
    """
    names = [{"service": SERVICE_NAME, "method": m} for m in RETRIED_METHODS]
    names.append({"service": HEALTH_SERVICE_NAME, "method": "Check"})
    policy = {
        "maxAttempts": max_attempts,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config: dict[str, Any] = {"methodConfig": [{"name": names, "retryPolicy": policy}]}
    if round_robin:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
    return json.dumps(config)


def channel_options(user_options: Sequence[tuple[str, Any]] | None, round_robin: bool = False
                    ) -> list[tuple[str, Any]]:
    """The client's default channel options (retries, 64 MiB messages, ``round_robin`` balancing when asked) with
    user_options overriding by key."""
    merged: dict[str, Any] = {
        "grpc.enable_retries": 1,
        "grpc.service_config": service_config_json(round_robin=round_robin),
        "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
        "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    }
    for key, value in user_options or ():
        merged[key] = value
    return list(merged.items())


def sampling_params(**fields: Any) -> pb.SamplingParams:
    """Build a SamplingParams message from keyword arguments named after its fields (``max_tokens``,
    ``temperature``, ``stop``, ``logit_bias``, ...: every field of the message, see API.md for meanings and
    defaults, vLLM SamplingParams semantics).

    None leaves a field unset (the server default applies). `stop` may be one string or several; repeated fields
    take any iterable; `logit_bias` a mapping of token id to bias. `structured_output` takes a StructuredOutput
    message, a mapping with one of its fields (``{"json_schema": {...}}`` (a dict or JSON text),
    ``{"json_object": True}``, ``{"regex": "..."}``, ``{"choice": ["yes", "no"]}``, ``{"grammar": "..."}``), or
    that mapping as JSON text.

    Raises:
        TypeError: an unknown field name, or a value protobuf rejects (e.g. a str for an int field).
        ValueError: a negative value in an unsigned field.
    """
    params = pb.SamplingParams()
    by_name = params.DESCRIPTOR.fields_by_name
    unknown = sorted(set(fields) - set(by_name))
    if unknown:
        raise TypeError(f"unknown sampling field(s) {unknown}; known: {sorted(by_name)}")
    for name, value in fields.items():
        if value is None:
            continue
        fd = by_name[name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            for key, item in dict(value).items():
                getattr(params, name)[int(key)] = float(item)
        elif name == "structured_output":
            params.structured_output.CopyFrom(structured_output(value))
        elif fd.is_repeated:
            getattr(params, name).extend([value] if isinstance(value, str) else list(value))
        else:
            setattr(params, name, value)
    return params


def structured_output(value: Any) -> pb.StructuredOutput:
    """A StructuredOutput message from a message, a mapping with exactly one of its fields, or that mapping as JSON
    text. ``json_schema`` may be a dict (sent as JSON text); ``choice`` a list of strings.

    Raises:
        TypeError: not one of those, or an unknown key. ValueError: not exactly one key, or JSON text that does not
            parse.
    """
    if isinstance(value, pb.StructuredOutput):
        return value
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"structured_output must be a mapping or a StructuredOutput, not {value!r}")
    kinds = pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields
    known = [fd.name for fd in kinds]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise TypeError(f"unknown structured_output field(s) {unknown}; known: {known}")
    if len(value) != 1:
        raise ValueError(f"structured_output takes exactly one of {known}, got {sorted(value)}")
    ((kind, item),) = value.items()
    msg = pb.StructuredOutput()
    if kind == "choice":
        msg.choice.choices.extend([item] if isinstance(item, str) else list(item))
    elif kind == "json_schema" and not isinstance(item, str):
        msg.json_schema = json.dumps(item)
    else:
        setattr(msg, kind, item)
    return msg


def chat_messages(messages: Iterable[Message]) -> pb.ChatMessages:
    """Chat turns as (role, content) pairs, {"role", "content"} dicts or ChatMessage to a ChatMessages message.

    Raises TypeError for any other item, KeyError for a dict without "role" or "content".
    """
    out = pb.ChatMessages()
    for item in messages:
        if isinstance(item, pb.ChatMessage):
            out.messages.append(item)
        elif isinstance(item, Mapping):
            msg = out.messages.add(role=item["role"], content=item.get("content") or "",
                                   tool_call_id=item.get("tool_call_id") or "", name=item.get("name") or "")
            msg.tool_calls.extend(_tool_call(c) for c in item.get("tool_calls") or ())
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            out.messages.add(role=item[0], content=item[1])
        else:
            raise TypeError(f"a chat message is (role, content), a dict or a ChatMessage, not {item!r}")
    return out


def _tool_call(call: Mapping[str, Any] | pb.ToolCall) -> pb.ToolCall:
    """An OpenAI tool call dict ({"id", "function": {"name", "arguments"}}) as a ToolCall (arguments as JSON)."""
    if isinstance(call, pb.ToolCall):
        return call
    fn = call.get("function", call)
    args = fn.get("arguments", "{}")
    return pb.ToolCall(id=call.get("id") or "", name=fn["name"],
                       arguments=args if isinstance(args, str) else json.dumps(args))


def tool(definition: Mapping[str, Any] | pb.Tool) -> pb.Tool:
    """An OpenAI tool ({"type": "function", "function": {"name", "description", "parameters"}}, or the function
    object alone) as a Tool message (parameters as JSON text)."""
    if isinstance(definition, pb.Tool):
        return definition
    fn = definition.get("function", definition)
    params = fn.get("parameters")
    return pb.Tool(name=fn["name"], description=fn.get("description") or "",
                   parameters_json="" if params is None else json.dumps(params))


def tool_choice_message(choice: str | Mapping[str, Any]) -> pb.ToolChoice:
    """OpenAI's tool_choice ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}) as a
    ToolChoice. Raises ValueError for another string."""
    if isinstance(choice, Mapping):
        return pb.ToolChoice(function_name=choice.get("function", choice)["name"])
    modes = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
             "required": pb.TOOL_CHOICE_MODE_REQUIRED}
    if choice not in modes:
        raise ValueError(f"tool_choice must be one of {list(modes)} or a function, not {choice!r}")
    return pb.ToolChoice(mode=modes[choice])


def generate_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Iterable[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    beam_search: Mapping[str, Any] | None = None,
    tools: Iterable[Mapping[str, Any] | pb.Tool] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    include_reasoning: bool | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """Build a GenerateRequest with exactly one input (prompt | prompt_token_ids | messages).

    `sampling` takes the keyword arguments of sampling_params(). `beam_search`: the BeamSearchParams fields
    (beam_width, length_penalty, early_stopping) to run beam search. `tools` / `tool_choice` /
    `parallel_tool_calls` take OpenAI's shapes (see tool(), tool_choice_message()). Raises ValueError unless exactly
    one input is given, TypeError for an unknown sampling keyword. `chat_template_kwargs`: more chat template
    variables for a messages input (e.g. ``{"enable_thinking": False}``); `include_reasoning`: False leaves
    reasoning_text out (a server with --reasoning-parser).
    """
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, prompt_token_ids, messages (got {given or 'none'})")
    request = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt,
                                 sampling=sampling_params(**sampling))
    if beam_search is not None:
        request.beam_search.CopyFrom(pb.BeamSearchParams(**beam_search))
    request.tools.extend(tool(t) for t in tools or ())
    if tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_message(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    if chat_template_kwargs is not None:
        request.chat_template_kwargs.update(dict(chat_template_kwargs))
    if include_reasoning is not None:
        request.include_reasoning = include_reasoning
    if prompt is not None:
        request.prompt = prompt
    elif prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    else:
        request.messages.CopyFrom(chat_messages(messages))
    return request


def embed_request(inputs: str | Iterable[str], normalize: bool | None = None, truncate: bool | None = None,
                  dimensions: int | None = None, request_id: str = "") -> pb.EmbedRequest:
    """Build an EmbedRequest; one string is a batch of one. None leaves normalize/truncate/dimensions unset."""
    request = pb.EmbedRequest(inputs=[inputs] if isinstance(inputs, str) else list(inputs), request_id=request_id)
    if normalize is not None:
        request.normalize = normalize
    if truncate is not None:
        request.truncate = truncate
    if dimensions is not None:
        request.dimensions = dimensions
    return request


def rerank_request(query: str, texts: str | Iterable[str], top_n: int | None = None, return_text: bool = False,
                   truncate: bool = False) -> pb.RerankRequest:
    """Build a RerankRequest; one string is a list of one text. None leaves top_n unset (every text returned)."""
    request = pb.RerankRequest(query=query, texts=[texts] if isinstance(texts, str) else list(texts),
                               return_text=return_text, truncate=truncate)
    if top_n is not None:
        request.top_n = top_n
    return request


def score_request(text_1: str | Iterable[str], text_2: str | Iterable[str], truncate: bool = False
                  ) -> pb.ScoreRequest:
    """Build a ScoreRequest; a string on either side is a list of one text (one text_1 scores every text_2)."""
    def as_list(texts: str | Iterable[str]) -> list[str]:
        return [texts] if isinstance(texts, str) else list(texts)
    return pb.ScoreRequest(text_1=as_list(text_1), text_2=as_list(text_2), truncate=truncate)


def tokenize_request(text: str | None = None, *, messages: Iterable[Message] | None = None,
                     add_special_tokens: bool | None = None,
                     add_generation_prompt: bool | None = None) -> pb.TokenizeRequest:
    """Build a TokenizeRequest from text or chat messages (exactly one). Raises ValueError otherwise."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    request = pb.TokenizeRequest()
    if text is not None:
        request.text = text
    else:
        request.messages.CopyFrom(chat_messages(messages))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if add_generation_prompt is not None:
        request.add_generation_prompt = add_generation_prompt
    return request


def detokenize_request(token_ids: Iterable[int], skip_special_tokens: bool | None = None) -> pb.DetokenizeRequest:
    """Build a DetokenizeRequest; None leaves skip_special_tokens unset (server default true)."""
    request = pb.DetokenizeRequest(token_ids=list(token_ids))
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


def abort_request(request_ids: str | Iterable[str]) -> pb.AbortRequest:
    """Build an AbortRequest; one string is one id."""
    return pb.AbortRequest(request_ids=[request_ids] if isinstance(request_ids, str) else list(request_ids))


def finish_reason_name(value: int) -> str:
    """FinishReason enum value to its short name: 1 -> "STOP" (UNSPECIFIED while a completion runs)."""
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_")


class TextAccumulator:
    """Joins the streamed deltas of a single-completion request into a GenerationResult."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._reasoning: list[str] = []
        self._finish_reason = pb.FINISH_REASON_UNSPECIFIED
        self._usage = pb.Usage()

    def add(self, response: pb.GenerateResponse) -> None:
        """Take one streamed response. Raises ValueError for a completion index other than 0."""
        if response.index != 0:
            raise ValueError(f"generate_text() handles n == 1 only; got completion index {response.index}")
        self._parts.append(response.text)
        self._reasoning.append(response.reasoning_text)
        if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finish_reason = response.finish_reason
        if response.HasField("usage"):
            self._usage.CopyFrom(response.usage)

    def result(self) -> GenerationResult:
        """The joined text, the finish reason name, the usage seen so far and the joined reasoning text."""
        return GenerationResult("".join(self._parts), finish_reason_name(self._finish_reason), self._usage,
                                "".join(self._reasoning))


def check_single_completion(sampling: Mapping[str, Any]) -> None:
    """generate_text() joins one completion: raise ValueError when n asks for more."""
    if sampling.get("n") not in (None, 1):
        raise ValueError("generate_text() handles n == 1 only; use generate() for n > 1")
