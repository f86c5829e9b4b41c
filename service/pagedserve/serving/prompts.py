"""Prompts as the front ends hand them over, and their rendering into token ids.

A front end maps its wire type (a ``GenerateRequest`` oneof, an OpenAI ``prompt``/``messages``) onto one of the
three prompt kinds here; :func:`render_prompt` turns it into the token ids the engine runs. Every error names the
request field the front end gave.
"""
from __future__ import annotations

from dataclasses import dataclass

import jinja2
from jinja2 import meta as jinja_meta

from ..errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str                          # tokenized as is
    add_special_tokens: bool = True    # the tokenizer's BOS etc. (HF ``encode`` semantics)
    field: str = "prompt"              # the request field, for errors


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    token_ids: tuple[int, ...]         # run as given (checked against the vocabulary by the engine)
    field: str = "prompt_token_ids"


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: tuple[dict, ...]         # {"role", "content"} each; also "tool_calls" / "tool_call_id" / "name"
    add_generation_prompt: bool = True  # end with the assistant turn's opening (HF ``apply_chat_template``)
    field: str = "messages"
    tools: tuple[dict, ...] | None = None  # OpenAI tool objects, the template's ``tools`` variable
    template_kwargs: dict | None = None  # more template variables (``chat_template_kwargs``, e.g. enable_thinking)
    template_kwargs_field: str = "chat_template_kwargs"


Prompt = TextPrompt | TokenPrompt | ChatPrompt


# Arguments of HF ``apply_chat_template`` that a request's template variables may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "tools", "chat_template",
                                      "add_generation_prompt", "return_dict", "return_tensors", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask", "continue_final_message", "documents"})


def check_template_kwargs(kwargs, field: str = "chat_template_kwargs") -> dict | None:
    """A request's extra chat-template variables (vLLM's ``chat_template_kwargs``) as a dict (None: none).

    Raises:
        InvalidInputError: not an object (``field``), or a key that names an argument of the render itself
            (``field.<key>``).
    """
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise InvalidInputError(f"must be an object of template variables, got {type(kwargs).__name__}", field)
    for key in kwargs:
        if not isinstance(key, str) or key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidInputError("is set by the request itself, not a template variable", f"{field}.{key}")
    return dict(kwargs)


def apply_chat_template(tokenizer, messages: list[dict], field: str, add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, chat_template: str | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
    """Render chat messages with the model's template (or ``chat_template``, the server's --chat-template) and
    tokenize (HF ``apply_chat_template`` semantics; ``tools`` is the template's ``tools`` variable, which a
    template without one ignores; ``template_kwargs`` are more variables, e.g. Qwen3's ``enable_thinking``).

    Raises:
        InvalidInputError: no messages, no chat template, or the template rejected them (field ``field``).
    """
    if not messages:
        raise InvalidInputError("needs at least one message", field)
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError("the model has no chat template; send a prompt or token ids instead", field)
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                            tools=tools, chat_template=chat_template, **(template_kwargs or {}))
    except Exception as exc:  # jinja errors from bad roles or content
        raise InvalidInputError(f"the chat template rejected the messages: {exc}", field) from exc
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def render_prompt(prompt: Prompt, tokenizer, chat_template: str | None = None) -> list[int]:
    """The prompt's token ids (``chat_template`` overrides the model's). Tokenizing is CPU work: call it off the
    event loop for long prompts.

    Raises:
        InvalidInputError: see :func:`apply_chat_template`; an empty token list (field of the prompt).
    """
    if isinstance(prompt, TextPrompt):
        return list(tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens))
    if isinstance(prompt, TokenPrompt):
        return list(prompt.token_ids)
    if isinstance(prompt, ChatPrompt):
        return apply_chat_template(tokenizer, list(prompt.messages), prompt.field, prompt.add_generation_prompt,
                                   list(prompt.tools) if prompt.tools else None, chat_template,
                                   check_template_kwargs(prompt.template_kwargs, prompt.template_kwargs_field))
    raise TypeError(f"not a prompt: {type(prompt).__name__}")


def template_renders_tools(template: str | dict | None) -> bool:
    """Whether a Jinja chat template references the ``tools`` variable (HF ``apply_chat_template``'s tool list),
    i.e. whether a request's ``tools`` can reach the prompt. ``template``: the template text, or a tokenizer's
    ``{name: text}`` dict of named templates (True when any of them does); None (no template) is False. A template
    that does not parse is read as text: True when the word ``tools`` appears in it."""
    if not template:
        return False
    if isinstance(template, dict):
        return any(template_renders_tools(t) for t in template.values())
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # as HF's renderer ({% break %})
        return "tools" in jinja_meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template
