"""Proto <-> engine conversion. Pure functions; every validation error names the request field."""
from __future__ import annotations

import math

from pagedserve_client.v1 import inference_pb2 as pb

from ..engine.llm_engine import CompletionDelta
from ..engine.sampling_params import SamplingParams
from ..errors import InvalidInputError

_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}
_OPTIONAL_SCALARS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
                     "ignore_eos", "n", "logprobs", "prompt_logprobs", "skip_special_tokens",
                     "truncate_prompt_tokens")


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Build engine SamplingParams; unset optional fields keep their defaults, an explicit 0 means 0.

    Raises:
        InvalidInputError: a value out of range (field ``sampling.<name>``).
    """
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
            if not math.isfinite(kwargs[name]):
                raise InvalidInputError(f"must be finite, got {kwargs[name]}", f"sampling.{name}")
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items()))
    return SamplingParams(**kwargs)


def messages_to_dicts(msgs: pb.ChatMessages, field: str) -> list[dict]:
    if not msgs.messages:
        raise InvalidInputError("needs at least one message", field)
    return [{"role": m.role, "content": m.content} for m in msgs.messages]


def apply_chat_template(tokenizer, messages: list[dict], field: str, add_generation_prompt: bool = True) -> list[int]:
    """Render chat messages with the model's template and tokenize (HF ``apply_chat_template`` semantics)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("the model has no chat template; send prompt or prompt_token_ids", field)
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors from bad roles or content
        raise InvalidInputError(f"the chat template rejected the messages: {exc}", field) from exc
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def prompt_from_proto(req: pb.GenerateRequest, tokenizer) -> list[int]:
    """The request's prompt token ids (``prompt`` is tokenized as is, with the tokenizer's special tokens).

    Raises:
        InvalidInputError: no input set (field ``input``).
    """
    which = req.WhichOneof("input")
    if which == "prompt":
        return list(tokenizer.encode(req.prompt))
    if which == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    if which == "messages":
        return apply_chat_template(tokenizer, messages_to_dicts(req.messages, "messages"), "messages")
    raise InvalidInputError("exactly one of prompt, prompt_token_ids or messages is required", "input")


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


def delta_to_proto(d: CompletionDelta, tokenizer) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=d.request_id, index=d.index, text=d.text, token_ids=d.token_ids,
                              finish_reason=_FINISH[d.finish_reason])
    if d.logprobs:
        msg.logprobs.extend(_logprob_entries(d.logprobs, tokenizer))
    if d.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_entries(d.prompt_logprobs, tokenizer))
    if isinstance(d.matched_stop, str):
        msg.matched_stop_str = d.matched_stop
    elif d.matched_stop is not None:
        msg.matched_stop_token_id = d.matched_stop
    if d.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=d.usage.prompt_tokens, completion_tokens=d.usage.completion_tokens,
                                    cached_prompt_tokens=d.usage.cached_prompt_tokens))
    return msg


def embed_options(req: pb.EmbedRequest) -> dict:
    """``Embedder.embed`` keyword arguments from an EmbedRequest (defaults: normalize true, truncate false)."""
    return {"normalize": req.normalize if req.HasField("normalize") else True,
            "truncate": req.truncate if req.HasField("truncate") else False,
            "dimensions": req.dimensions if req.HasField("dimensions") else None}
