"""Proto <-> plain serving types. Pure functions; every validation error names the request field.

The sampling fields are not listed here: :func:`sampling_from_proto` walks the ``SamplingParams`` message's
descriptor, and a test checks that its fields and the engine's :class:`SamplingParams` fields are the same set.
"""
from __future__ import annotations

import json

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from pagedserve_client.v1 import inference_pb2 as pb

from ..errors import InvalidInputError
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutput
from ..serving.generation import GenerateCall
from ..serving.pipeline import ChoiceDelta, GenerationRequest
from ..serving.prompts import ChatPrompt, Prompt, TextPrompt, TokenPrompt, check_template_kwargs
from .tool_convert import tool_plan_from_proto

_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT, "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
_FLOAT_TYPES = (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)


def sampling_from_proto(msg: pb.SamplingParams, beam_search: pb.BeamSearchParams | None = None) -> SamplingParams:
    """Build engine SamplingParams from every field of the message: unset optional fields keep the engine's
    defaults, an explicit 0 means 0; repeated fields become tuples, the ``logit_bias`` map sorted pairs, a set
    message field goes through its converter in ``_MESSAGE_FIELDS`` (``structured_output``).

    Raises:
        InvalidInputError: a value out of range, or not finite (field ``sampling.<name>``).
    """
    kwargs: dict = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            kwargs[fd.name] = tuple(sorted((int(k), float(v)) for k, v in value.items()))
        elif fd.is_repeated:
            kwargs[fd.name] = tuple(value)
        elif fd.message_type is not None:
            if msg.HasField(fd.name):
                kwargs[fd.name] = _MESSAGE_FIELDS[fd.name](value)
        elif msg.HasField(fd.name):
            kwargs[fd.name] = float(value) if fd.cpp_type in _FLOAT_TYPES else value
    if beam_search is not None:  # beam search is greedy: temperature defaults to 0 with it
        kwargs.setdefault("temperature", 0.0)
        kwargs["beam_search"] = beam_search_from_proto(beam_search)
    return SamplingParams(**kwargs)


def beam_search_from_proto(msg: pb.BeamSearchParams) -> BeamSearchParams:
    """BeamSearchParams from the message (unset optional fields: length_penalty 1.0, early_stopping false).

    Raises:
        InvalidInputError: beam_width < 2 or too large, length_penalty not finite (``beam_search.<field>``).
    """
    return BeamSearchParams(int(msg.beam_width),
                            float(msg.length_penalty) if msg.HasField("length_penalty") else 1.0,
                            bool(msg.early_stopping) if msg.HasField("early_stopping") else False)


def structured_output_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    """The constraint of a StructuredOutput message (its ``kind`` oneof).

    Raises:
        InvalidInputError: no kind set (field ``sampling.structured_output``), or what StructuredOutput raises
            (``sampling.structured_output.<field>``).
    """
    kind = msg.WhichOneof("kind")
    if kind is None:
        return StructuredOutput()  # raises: exactly one kind must be set
    value = getattr(msg, kind)
    return StructuredOutput(**{kind: list(value.choices) if kind == "choice" else value})


_MESSAGE_FIELDS = {"structured_output": structured_output_from_proto}


def messages_from_proto(msgs: pb.ChatMessages, field: str) -> tuple[dict, ...]:
    """Chat messages as ``{"role", "content"}`` dicts, with ``tool_calls`` (arguments parsed, as templates render
    them), ``tool_call_id`` and ``name`` when set. Raises InvalidInputError (``field``) when empty, or naming a
    call's arguments that are not JSON."""
    if not msgs.messages:
        raise InvalidInputError("needs at least one message", field)
    return tuple(_message(m, f"{field}[{i}]") for i, m in enumerate(msgs.messages))


def _message(m: pb.ChatMessage, field: str) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(c.arguments, f"{field}.tool_calls[{j}]")}}
            for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(text: str, field: str) -> dict:
    try:
        return json.loads(text or "{}")
    except ValueError:
        raise InvalidInputError("must be JSON text", f"{field}.arguments") from None


def prompt_from_proto(req: pb.GenerateRequest) -> Prompt:
    """The request's prompt (``prompt`` is tokenized as is, with the tokenizer's special tokens).

    Raises:
        InvalidInputError: no input set (field ``input``), no chat messages, a ``chat_template_kwargs`` key the
            render sets itself (``chat_template_kwargs.<key>``).
    """
    which = req.WhichOneof("input")
    if which == "prompt":
        return TextPrompt(req.prompt)
    if which == "prompt_token_ids":
        return TokenPrompt(tuple(req.prompt_token_ids.ids))
    if which == "messages":
        kwargs = None
        if req.HasField("chat_template_kwargs"):
            kwargs = check_template_kwargs(json_format.MessageToDict(req.chat_template_kwargs))
        return ChatPrompt(messages_from_proto(req.messages, "messages"), template_kwargs=kwargs)
    raise InvalidInputError("exactly one of prompt, prompt_token_ids or messages is required", "input")


def generate_call_from_proto(req: pb.GenerateRequest, deadline: float | None = None, caller: str = "") -> GenerateCall:
    """A :class:`GenerateCall` from a GenerateRequest (empty request_id / cache_salt mean none); ``deadline``: the
    call's gRPC deadline as ``time.monotonic()`` seconds; ``caller``: its sender's name (fair shares)."""
    beam = req.beam_search if req.HasField("beam_search") else None
    return GenerateCall(prompt_from_proto(req), sampling_from_proto(req.sampling, beam), req.request_id or None,
                        req.priority, req.cache_salt or None, deadline, caller)


def generation_request_from_proto(req: pb.GenerateRequest, auto_tool_parser: str | None,
                                  deadline: float | None = None, caller: str = "",
                                  reasoning: bool = False) -> GenerationRequest:
    """The pipeline request of a GenerateRequest: its one call, its tool plan and, with ``reasoning`` (the server
    has a --reasoning-parser), the reasoning split of every input kind (``include_reasoning`` default true). The
    gRPC API's field names are the engine's. Raises InvalidInputError naming the field."""
    plan = tool_plan_from_proto(req, auto_tool_parser)
    include = req.include_reasoning if req.HasField("include_reasoning") else True
    return GenerationRequest((generate_call_from_proto(req, deadline, caller),), plan, reasoning=reasoning,
                             include_reasoning=include)


def tokenize_prompt_from_proto(req: pb.TokenizeRequest) -> Prompt:
    """The prompt of a TokenizeRequest (defaults: special tokens added, generation prompt added).

    Raises:
        InvalidInputError: neither text nor messages (field ``input``).
    """
    which = req.WhichOneof("input")
    if which == "messages":
        add_gen = req.add_generation_prompt if req.HasField("add_generation_prompt") else True
        return ChatPrompt(messages_from_proto(req.messages, "messages"), add_gen)
    if which == "text":
        add_special = req.add_special_tokens if req.HasField("add_special_tokens") else True
        return TextPrompt(req.text, add_special, field="text")
    raise InvalidInputError("exactly one of text or messages is required", "input")


def _logprob_entries(lps, tokenizer) -> list[pb.TokenLogprob]:
    out = []
    for lp in lps:
        ids = [lp.token_id] + [t for t, _ in lp.top]
        names = tokenizer.convert_ids_to_tokens(ids)
        entry = pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, token=names[0] or "")
        for rank, ((tid, logprob), name) in enumerate(zip(lp.top, names[1:]), start=1):
            entry.top_logprobs.add(token_id=tid, logprob=logprob, rank=rank, token=name or "")
        out.append(entry)
    return out


def choice_to_proto(choice: ChoiceDelta, tokenizer, reasoning_tokens: int = 0) -> pb.GenerateResponse:
    """A GenerateResponse from one pipeline delta: the choice's content as ``text``, its reasoning as
    ``reasoning_text``, its tool-call pieces as ``tool_calls``, its finish reason (FINISH_REASON_TOOL_CALLS for a
    choice that called tools and stopped); ``reasoning_tokens``: the request's so far (for ``usage``)."""
    d = choice.delta
    msg = pb.GenerateResponse(request_id=d.request_id, index=d.index, text=choice.content, token_ids=d.token_ids,
                              finish_reason=_FINISH[choice.finish_reason], reasoning_text=choice.reasoning or "")
    for c in choice.tool_calls:
        fn = c["function"]
        msg.tool_calls.add(index=c["index"], id=c.get("id", ""), name=fn.get("name", ""),
                           arguments=fn.get("arguments", ""))
    if d.logprobs:
        msg.logprobs.extend(_logprob_entries(d.logprobs, tokenizer))
    if d.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_entries(d.prompt_logprobs, tokenizer))
    if isinstance(d.matched_stop, str):
        msg.matched_stop_str = d.matched_stop
    elif d.matched_stop is not None:
        msg.matched_stop_token_id = d.matched_stop
    if d.cumulative_logprob is not None:
        msg.cumulative_logprob = d.cumulative_logprob
    if d.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=d.usage.prompt_tokens, completion_tokens=d.usage.completion_tokens,
                                    cached_prompt_tokens=d.usage.cached_prompt_tokens,
                                    reasoning_tokens=reasoning_tokens))
    return msg


def embed_options(req: pb.EmbedRequest) -> dict:
    """``EmbeddingService.embed`` keyword arguments from an EmbedRequest (defaults: normalize true, truncate
    false, all dimensions)."""
    return {"normalize": req.normalize if req.HasField("normalize") else True,
            "truncate": req.truncate if req.HasField("truncate") else False,
            "dimensions": req.dimensions if req.HasField("dimensions") else None}
