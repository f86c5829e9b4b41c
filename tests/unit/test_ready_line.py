"""The server's ready line (entrypoints/app.py ``App._log_summary``) says what the /v1/models card says about the
model's shape: the distinct sliding windows ([] for a model without) and the experts (0 for a dense model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from pagedserve.engine.builder import EngineInfo
from pagedserve.entrypoints.app import App
from pagedserve.http.openai_serving import OpenAIServing


def _services(info: EngineInfo) -> SimpleNamespace:
    config = SimpleNamespace(deadline_scheduling=True, max_queue_time_s=None, reasoning_parser=None)
    generation = SimpleNamespace(info=info, engine=SimpleNamespace(engine=SimpleNamespace(config=config)))
    return SimpleNamespace(generation=generation, generation_name=info.name, embedding=None, embedding_name=None,
                           rerank=None, tracing=None)


def _ready_line(services: SimpleNamespace) -> dict:
    app = SimpleNamespace(services=services, port=50051, http_port=None, metrics_port=None,
                          api_keys=SimpleNamespace(enabled=False),
                          server_config=SimpleNamespace(host="127.0.0.1", tls=False, ssl_ca_certs=None,
                                                        fair_share_by=None))
    with capture_logs() as logs:
        App._log_summary(app, 0.0)
    [ready] = [e for e in logs if e["event"] == "ready"]
    return ready


@pytest.mark.parametrize("windows, experts, want", [((), 0, ([], 0)), ((128, 0, 128, 0), 32, ([128], 32))])
def test_the_ready_line_gives_windows_and_experts_as_the_model_card(windows, experts, want):
    info = EngineInfo(name="m", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
                      attention_backend="cpu", max_model_len=4096, vocab_size=256, block_size=16, num_kv_blocks=64,
                      kv_block_bytes=4096, prefix_caching=True, quantization="none", num_layers=4, num_kv_heads=2,
                      head_dim=64, sliding_windows=windows, num_experts=experts,
                      num_experts_per_token=4 if experts else 0)
    services = _services(info)
    ready = _ready_line(services)
    card = OpenAIServing(services).model_details("m")
    assert (ready["sliding_windows"], ready["num_experts"]) == want == (card["sliding_windows"], card["num_experts"])
