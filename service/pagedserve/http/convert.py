"""OpenAI request bodies -> plain serving types, and engine outputs -> OpenAI response pieces. Pure functions;
errors name the body field (``param``) as the client wrote it."""
from __future__ import annotations

import json
import time
import uuid

from ..errors import InvalidInputError
from ..outputs import TokenLogprobs
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutput
from ..serving.caller_errors import SAMPLING_PREFIX, FieldNames
from ..serving.pipeline import UsageTotal
from ..serving.prompts import ChatPrompt, Prompt, TextPrompt, TokenPrompt, check_template_kwargs
from .errors import OpenAIError
from .token_bytes import TokenBytes
from .protocol import SAMPLING_BODY_FIELDS, UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest

FINGERPRINT = "pagedserve-0.1.0"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def check_unsupported(body) -> None:
    """Raises a 400 naming the first field this server does not support (tools, audio, ...)."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED_FIELDS:
        if extra.get(name) not in (None, [], {}):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name, code="unsupported")


def check_best_of(body: ChatCompletionRequest | CompletionRequest) -> None:
    """``best_of``: unset or 1 (OpenAI's default: each completion is the one sampled) is accepted; more, or fewer
    than ``n``, is a 400 naming ``best_of`` (this server does not sample candidates to rank)."""
    best_of, n = body.best_of, 1 if body.n is None else body.n
    if best_of is None:
        return
    if best_of < 1 or best_of < n:
        raise OpenAIError(400, f"must be >= 1 and >= n ({n}), got {best_of}", param="best_of")
    if best_of > 1:
        raise OpenAIError(400, f"{best_of} is not supported (only 1: this server does not sample candidates to "
                          "rank); ask for n completions instead", param="best_of", code="unsupported")


def sampling_params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from the body's OpenAI and vLLM fields; unset fields keep the engine defaults.

    Raises:
        InvalidInputError: a value out of range (field ``sampling.<name>``, shown to the client without the
            prefix), or a ``logit_bias`` key that is not a token id.
    """
    kwargs: dict = {name: getattr(body, name) for name in SAMPLING_BODY_FIELDS if getattr(body, name) is not None}
    if body.logit_bias:
        try:
            kwargs["logit_bias"] = tuple((int(k), float(v)) for k, v in body.logit_bias.items())
        except ValueError:
            raise InvalidInputError("keys must be token ids (integers as strings)", "sampling.logit_bias") from None
    kwargs.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    constraint = structured_output(body)
    if constraint is not None:
        kwargs["structured_output"] = constraint[0]
    if body.use_beam_search:
        kwargs["beam_search"] = beam_search(body)
        kwargs.setdefault("temperature", 0.0)
    return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def beam_search(body: ChatCompletionRequest | CompletionRequest) -> BeamSearchParams:
    """vLLM's ``use_beam_search`` extra: beam width ``n`` (so n >= 2), ``length_penalty``, ``early_stopping``.

    Raises:
        InvalidInputError: n < 2, or a bad length_penalty / early_stopping (the field as the body names it).
    """
    n = 1 if body.n is None else body.n
    if n < 2:
        raise InvalidInputError(f"must be >= 2 with use_beam_search (it is the beam width), got {n}",
                                "sampling.n")
    try:
        return BeamSearchParams(n, 1.0 if body.length_penalty is None else body.length_penalty,
                                bool(body.early_stopping))
    except InvalidInputError as exc:
        name = exc.field.removeprefix("beam_search.")
        raise InvalidInputError(str(exc).removeprefix(f"{exc.field}: "), "n" if name == "beam_width" else name) \
            from None


# vLLM's structured_outputs keys -> StructuredOutput fields; option keys accepted and ignored (this server's JSON
# never has free whitespace, and there is no fallback backend).
_VLLM_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
_VLLM_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _constraint_sources(body: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The body fields that ask for a structured output constraint, in the order they are read."""
    rf = body.response_format
    names = ["response_format"] if rf is not None and rf.get("type", "text") != "text" else []
    if body.structured_outputs:
        names.append("structured_outputs")
    return names + [name for name in _GUIDED if getattr(body, name) is not None]


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> tuple[StructuredOutput, str] | None:
    """The body's constraint and the body field that gave it, from exactly one of: OpenAI's ``response_format``
    (``json_object``; ``json_schema`` with its ``schema``; ``text`` is none), vLLM's ``structured_outputs``
    (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) or vLLM's ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``. None when the body asks for none.

    Raises:
        OpenAIError: 400 naming the field: two of them at once, an unknown type or key, a bad value.
    """
    found: list[tuple[dict, str]] = []
    for name in _constraint_sources(body):
        if name == "response_format":
            found.append((_from_response_format(body.response_format), name))
        elif name == "structured_outputs":
            found.append((_from_vllm(body.structured_outputs), name))
        else:
            found.append(({_GUIDED[name]: getattr(body, name)}, name))
    if not found:
        return None
    if len(found) > 1:
        raise OpenAIError(400, f"give one structured output constraint, not {found[0][1]} and {found[1][1]}",
                          param=found[1][1])
    value, param = found[0]
    try:
        return StructuredOutput.from_value(value), param
    except InvalidInputError as exc:
        raise OpenAIError(400, str(exc).removeprefix(f"{exc.field}: "), param=param) from None


def _from_response_format(rf: dict) -> dict:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise OpenAIError(400, "json_schema needs a `schema`", param="response_format.json_schema.schema")
        return {"json_schema": spec["schema"]}
    raise OpenAIError(400, f"type {kind!r} is not supported (text, json_object, json_schema)",
                      param="response_format.type", code="unsupported")


def _from_vllm(so: dict) -> dict:
    unknown = sorted(k for k in so if k not in _VLLM_KINDS and k not in _VLLM_IGNORED)
    if unknown:
        raise OpenAIError(400, f"unsupported key(s) {unknown}; supported: {', '.join(_VLLM_KINDS)}",
                          param="structured_outputs", code="unsupported")
    return {_VLLM_KINDS[k]: v for k, v in so.items() if k in _VLLM_KINDS and v not in (None, False)}


def constraint_field(body) -> str:
    """The body field a structured output constraint (or its compile error) is named by: the field that asked for
    it, else ``tools`` (a tool choice's constraint), else ``structured_output``."""
    sources = _constraint_sources(body)
    return sources[0] if sources else ("tools" if getattr(body, "tools", None) else "structured_output")


def chat_fields(body: ChatCompletionRequest) -> FieldNames:
    """How a chat body spells the fields engine errors name: the sampling fields at the top level, the prompt as
    ``messages``, ``logprobs`` (a count) as ``top_logprobs``, ``max_tokens`` as ``max_completion_tokens`` when that
    was sent, the constraint as the field that asked for it."""
    renames = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    return FieldNames(renames, SAMPLING_PREFIX, constraint_field(body))


def completion_fields(body: CompletionRequest) -> FieldNames:
    """How a completions body spells them: token ids as ``prompt``, prompt logprobs as ``logprobs`` (echo)."""
    return FieldNames({"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}, SAMPLING_PREFIX,
                      constraint_field(body))


def embedding_fields(body) -> FieldNames:
    """How an embeddings body spells them: ``inputs`` as ``input`` (one text: ``input`` alone, no index)."""
    renames = {"inputs[0]": "input", "inputs": "input"} if isinstance(body.input, str) else {"inputs": "input"}
    return FieldNames(renames, SAMPLING_PREFIX)


def chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
    """The chat messages (and ``tools``) as a prompt; a content list keeps its text parts (joined), other parts are
    a 400. Assistant ``tool_calls`` keep their ids and names with the arguments parsed from their JSON text (chat
    templates render them as objects, as in vLLM); a tool message keeps its ``tool_call_id``; vLLM's
    ``chat_template_kwargs`` become more template variables.

    Raises:
        InvalidInputError: ``chat_template_kwargs`` with a key the render sets itself (naming
            ``chat_template_kwargs.<key>``).
        OpenAIError: a content part that is not text, a malformed assistant tool call.
    """
    messages = []
    for i, m in enumerate(body.messages):
        message = {"role": m.role, "content": _content_text(m.content, i) or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tools = getattr(body, "tools", None)
    kwargs = check_template_kwargs(getattr(body, "chat_template_kwargs", None))
    return ChatPrompt(tuple(messages), body.add_generation_prompt, tools=tuple(tools) if tools else None,
                      template_kwargs=kwargs)


def _content_text(content, i: int) -> str | None:
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"content part type {part.get('type')!r} is not supported (text only)",
                              param=f"messages[{i}].content[{j}]", code="unsupported")
        texts.append(part["text"])
    return "".join(texts)


def _template_call(call: dict, param: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise OpenAIError(400, 'must be {"id", "type": "function", "function": {"name", "arguments"}}', param=param)
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise OpenAIError(400, "must be a JSON text", param=f"{param}.function.arguments") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def completion_prompts(prompt) -> list[Prompt]:
    """``prompt`` (a string, strings, token ids or lists of token ids) as one prompt per completion batch entry."""
    if isinstance(prompt, str):
        return [TextPrompt(prompt)]
    if not prompt:
        raise InvalidInputError("must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [TokenPrompt(tuple(prompt), field="prompt")]
    if all(isinstance(p, str) for p in prompt):
        return [TextPrompt(p, field=f"prompt[{i}]") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [TokenPrompt(tuple(p), field=f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidInputError("must be a string, a list of strings, token ids, or lists of token ids", "prompt")


def usage_dict(usage: UsageTotal, prompt_only: bool = False, reasoning: bool = False) -> dict:
    """OpenAI's ``usage`` of a request's token counts (``prompt_only``: no completion tokens, the scoring path;
    ``reasoning``: with ``completion_tokens_details.reasoning_tokens``, OpenAI's name for the reasoning's share)."""
    completion = 0 if prompt_only else usage.completion_tokens
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion,
           "total_tokens": usage.prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}
    if reasoning:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


class TokenText:
    """Token id -> its text as a client sees it (the id decoded alone), cached; ``bytes(id)`` its own bytes;
    ``label(id)`` how logprobs name it: its text, or with vLLM's ``return_tokens_as_token_ids`` (``as_ids``)
    ``"token_id:<id>"`` (a token that is a piece of a character stays identifiable)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.bytes = TokenBytes(tokenizer)
        self.as_ids = as_ids

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self(token_id)

    def decode(self, token_ids: list[int]) -> str:
        """The text of a token sequence (special tokens kept)."""
        return self._tokenizer.decode(token_ids)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def chat_logprobs(lps: list[TokenLogprobs], text: TokenText) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries (``token`` as ``text.label`` names it); ``bytes`` are the token's own
    (a piece of a character's UTF-8)."""
    def entry(tid: int, lp: float) -> dict:
        return {"token": text.label(tid), "logprob": lp, "bytes": list(text.bytes(tid))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


class CompletionLogprobs:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset), built incrementally;
    tokens as ``text.label`` names them, ``text_offset`` in the text's characters."""

    def __init__(self, text: TokenText, offset: int = 0):
        self._text = text
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add_token(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        self.tokens.append(self._text.label(token_id))
        self.token_logprobs.append(logprob)
        if top is not None:  # the chosen (or prompt) token next to the top k, as OpenAI and vLLM report it
            top = [(token_id, logprob), *((t, v) for t, v in top if t != token_id)]
        self.top_logprobs.append(None if top is None else {self._text.label(t): v for t, v in top})
        self.text_offset.append(self.offset)
        self.offset += len(self._text(token_id))

    def add(self, lps: list[TokenLogprobs]) -> None:
        for lp in lps:
            self.add_token(lp.token_id, lp.logprob, lp.top)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        """What was added since the last take (for a stream chunk)."""
        out = self.as_dict()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
