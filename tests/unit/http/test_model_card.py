"""/v1/models cards say what the generation model is (http/openai_serving.py model_details): a gpt-oss-shaped
model's architecture, its distinct windows, experts and KV layout as EngineInfo (GetModelInfo's source) holds them;
nothing for another model name."""
from __future__ import annotations

from types import SimpleNamespace

from pagedserve.engine.builder import EngineInfo
from pagedserve.http.openai_serving import OpenAIServing


def test_model_details_of_a_windowed_mixture_of_experts_model():
    info = EngineInfo(name="tiny-gpt-oss", architecture="GptOssForCausalLM", dtype="float32", device="cpu",
                      attention_backend="cpu", max_model_len=4096, vocab_size=256, block_size=16, num_kv_blocks=64,
                      kv_block_bytes=4096, prefix_caching=True, quantization="none", kv_cache_dtype="bfloat16",
                      num_layers=4, num_kv_heads=2, head_dim=64, sliding_windows=(128, 0, 128, 0), num_experts=32,
                      num_experts_per_token=4)
    services = SimpleNamespace(generation=SimpleNamespace(info=info), generation_name="tiny-gpt-oss",
                               embedding=None, embedding_name=None, rerank=None)
    serving = OpenAIServing(services)
    assert serving.model_details("tiny-gpt-oss") == {
        "architecture": "GptOssForCausalLM", "sliding_windows": [128], "num_experts": 32,
        "num_experts_per_token": 4, "kv_layout": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
                                                  "kv_cache_dtype": "bfloat16", "block_size": 16}}
    assert serving.model_details("other") == {}
