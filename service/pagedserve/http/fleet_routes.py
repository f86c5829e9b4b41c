"""Routes a load balancer in front of several replicas asks each replica (vLLM's shapes; vllm-router's policies).

``POST /v1/chat/completions/render``: the chat body as it would be admitted, without generating. The answer is
vLLM's token-in request (``GenerateRequest``): ``token_ids`` (the prompt after the chat template, what the engine's
prefix cache keys on), ``sampling_params`` (the engine's values, with the defaults filled in), ``model``,
``request_id`` (``chatcmpl-...`` unless the body gives one), ``stream``, ``stream_options``, ``cache_salt``,
``priority``, and ``features`` / ``token_offsets`` (always null: no multimodal inputs, no offsets).

``POST /v1/completions/render``: a list of the same, one per prompt of the body (``request_id`` ``cmpl-...``).

Both check the body exactly as the generating endpoints do (400 naming the field, 404 for another ``model``);
unknown fields a router adds (``no_stop_trim``, ``separate_reasoning``, ...) are accepted and ignored.

``GET /get_load``: ``{"load", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}``, read from
the engine's scheduler and block pool at call time. ``load`` (running + waiting requests) is the number
vllm-router's ``power_of_two`` policy compares (it polls this path); the others use vLLM's metric names. Before the
model has loaded, 503 like every API path. Open like ``/health`` (no API key): it tells only counts.
"""
from __future__ import annotations

from fastapi import APIRouter

from ..sampling_params import SamplingParams
from ..serving.generation import GenerateCall
from ..serving.services import Services
from . import convert as cv
from .errors import OpenAIError
from .protocol import ChatCompletionRequest, CompletionRequest

# SamplingParams fields echoed in a rendered request: vLLM's SamplingParams names, plain JSON values.
_ECHOED = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "include_stop_str_in_output",
           "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens", "truncate_prompt_tokens")


def sampling_params_dict(params: SamplingParams) -> dict:
    """The JSON-plain fields of ``params`` under vLLM's names (tuples as lists); ``logit_bias`` as a mapping of
    token id (string) to bias, and ``structured_output`` / ``beam_search`` as booleans saying whether one is set."""
    out = {name: getattr(params, name) for name in _ECHOED}
    out["stop"], out["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    out["logit_bias"] = {str(t): b for t, b in params.logit_bias} or None
    out["structured_output"] = params.structured_output is not None
    out["beam_search"] = params.beam_search is not None
    return out


def _generate_request(request_id: str, ids: list[int], params: SamplingParams, model: str, body) -> dict:
    return {"request_id": request_id, "token_ids": ids, "features": None, "token_offsets": None,
            "sampling_params": sampling_params_dict(params), "model": model, "stream": body.stream,
            "stream_options": body.stream_options.model_dump() if body.stream_options else None,
            "cache_salt": body.cache_salt, "priority": body.priority}


def build_router(services: Services) -> APIRouter:
    """The three routes over ``services`` (mounted by :func:`pagedserve.http.app.build_app`)."""
    router = APIRouter()

    def check_model(model: str | None) -> str:
        served = services.generation_name
        if model is None or model == served:
            return served
        raise OpenAIError(404, f"The model `{model}` does not exist (this server's generation model is `{served}`)",
                          "not_found_error", "model", "model_not_found")

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict:
        cv.check_unsupported(body)
        generation = services.require_generation()
        model = check_model(body.model)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = cv.sampling_params(body, body.max_completion_tokens or body.max_tokens, k)
        ids = await generation.prepare(GenerateCall(cv.chat_prompt(body), params, body.request_id, body.priority,
                                                    body.cache_salt))
        return _generate_request(body.request_id or cv.new_id("chatcmpl"), ids, params, model, body)

    @router.post("/v1/completions/render")
    async def render_completions(body: CompletionRequest) -> list[dict]:
        cv.check_unsupported(body)
        generation = services.require_generation()
        model = check_model(body.model)
        params = cv.sampling_params(body, body.max_tokens, body.logprobs)
        prompts = cv.completion_prompts(body.prompt)
        base = body.request_id or cv.new_id("cmpl")
        out = []
        for i, prompt in enumerate(prompts):
            rid = f"{base}-{i}" if len(prompts) > 1 else base
            ids = await generation.prepare(GenerateCall(prompt, params, rid, body.priority, body.cache_salt))
            out.append(_generate_request(rid, ids, params, model, body))
        return out

    @router.get("/get_load")
    async def get_load() -> dict:
        stats = services.require_generation().engine.engine.stats()
        running, waiting = stats["num_requests_running"], stats["num_requests_waiting"]
        return {"load": running + waiting, "num_requests_running": running, "num_requests_waiting": waiting,
                "kv_cache_usage_perc": float(stats["usage"])}

    return router
