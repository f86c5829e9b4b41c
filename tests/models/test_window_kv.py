"""KV blocks of a sliding-window model (every layer windowed: Mistral, Phi-3): blocks behind the window are given back
while a request runs (core/kv_cache/manager.py ``sliding_window``), and the output stays transformers' greedy.
A model with a full-attention layer keeps every block (its full layers need them)."""
from __future__ import annotations

import random

import pytest
import torch

from family_cases import hf_config, hf_greedy, save_random_checkpoint

WINDOW, BLOCK, CHUNK = 24, 16, 64


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(HF model, our model, config) of a 3-layer Mistral with a 24-token window on every layer, 8k positions."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    path = tmp_path_factory.mktemp("mistral-window-8k")
    hf = save_random_checkpoint(hf_config("mistral-window", max_position_embeddings=8192), path)
    src = ModelSource.resolve(str(path))
    cfg = src.load_config()
    return hf, build_model(src, cfg, torch.float32, "cpu"), cfg


def _engine(model, cfg, num_kv_blocks: int):
    from backend_cases import word_tokenizer
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    config = EngineConfig(device="cpu", dtype="float32", attention_backend="cpu", num_kv_blocks=num_kv_blocks,
                          block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    return build_engine(config, model=model, tokenizer=word_tokenizer(256), hf_config=cfg)[0]


def _run(engine, prompts: dict[str, list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Greedy outputs, and the most blocks any one request held at the end of a step."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out, most = {rid: [] for rid in prompts}, 0
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
        running = engine.scheduler.running
        most = max([most] + [engine.kv_cache.num_blocks_held(r) for r in running])
    return out, most


def _metrics_text(engine) -> str:
    """The Prometheus text /metrics would serve for ``engine`` (model name "m")."""
    from prometheus_client import generate_latest

    from pagedserve.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.model_name, metrics.engine_stats = "m", engine.stats
    return generate_latest(metrics.registry).decode()



def test_a_4096_token_request_holds_only_its_window(windowed):
    """A 4,096-token prompt (64-token chunks) and 8 generated tokens, beside a short request: at every step a
    request holds at most the blocks of its window plus the step's chunk (ceil((24 - 1 + 64) / 16) + 1 = 7 of the
    257 its context spans), the pool is whole again at the end, and the tokens equal transformers' greedy ones."""
    hf, model, cfg = windowed
    rng = random.Random(3)
    prompts = {"long": rng.choices(range(2, 256), k=4096), "short": rng.choices(range(2, 256), k=40)}
    engine = _engine(model, cfg, num_kv_blocks=64)   # 64 blocks: 1,024 tokens, a quarter of the long context
    assert engine.kv_cache.sliding_window == WINDOW
    out, most = _run(engine, prompts, 8)
    assert most <= -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # the counter behind /metrics' pagedserve:kv_blocks_freed_behind_window: the long request gave back all but the
    # last window's blocks of its 257 while it ran (the short one, 3 blocks, at most 1)
    freed = engine.kv_cache.num_window_freed_blocks
    assert 257 - 3 <= freed <= 257 + 1 and engine.stats()["kv_blocks_freed_behind_window"] == freed
    assert f'pagedserve:kv_blocks_freed_behind_window_total{{model_name="m"}} {float(freed)}' in _metrics_text(engine)
    assert out == {rid: hf_greedy(hf, ids, 8) for rid, ids in prompts.items()}


def test_prefix_cache_hits_and_misses_stay_exact(windowed):
    """The same long prompt twice: with a pool large enough that the given-back blocks stay cached, the second run
    takes them as a prefix-cache hit; with a small pool they are reused in between (a miss, recomputed). Both give
    the first run's tokens."""
    _, model, cfg = windowed
    rng = random.Random(4)
    prompt = {"p": rng.choices(range(2, 256), k=1000)}
    big = _engine(model, cfg, num_kv_blocks=128)
    first, _ = _run(big, prompt, 6)
    big.kv_cache.reset_stats()
    again, _ = _run(big, {"p2": prompt["p"]}, 6)
    assert big.kv_cache.stats.hits_tokens >= 900 and again["p2"] == first["p"]
    small = _engine(model, cfg, num_kv_blocks=16)
    _run(small, prompt, 6)
    small.kv_cache.reset_stats()
    miss, _ = _run(small, {"p2": prompt["p"]}, 6)
    assert small.kv_cache.stats.hits_tokens < 100 and miss["p2"] == first["p"]
    assert small.kv_cache.num_free_blocks == small.kv_cache.num_blocks


def test_a_full_attention_layer_keeps_every_block(tmp_path):
    """Qwen2 with windows from layer 1 on (layer 0 full attention): nothing is given back."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    save_random_checkpoint(hf_config("qwen2-window"), tmp_path)
    src = ModelSource.resolve(str(tmp_path))
    cfg = src.load_config()
    engine = _engine(build_model(src, cfg, torch.float32, "cpu"), cfg, num_kv_blocks=64)
    assert engine.kv_cache.sliding_window is None
    _, most = _run(engine, {"r": random.Random(5).choices(range(2, 256), k=300)}, 4)
    assert most == -(-(300 + 4 - 1) // BLOCK)
