"""KV blocks of sliding-window models: blocks behind the window are given back while a request runs
(core/kv_cache/manager.py), and the output stays transformers' greedy. Every layer windowed (Mistral, Phi-3): one
block table, a request holds its window's blocks. Full-attention layers beside windowed ones (Gemma 2/3, gpt-oss,
Qwen2 from ``max_window_layers``): one block table per layer group (pagedserve/kv_layout.py), the full groups keep
every block of the context and the window groups only their window's."""
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


def _held_per_group(engine, request) -> list[int]:
    kv = engine.kv_cache
    return [kv.num_blocks_held(request, g) for g in range(kv.num_groups)]


def test_hybrid_model_holds_full_blocks_only_for_its_full_layers(tmp_path):
    """Gemma 3 with layers [window 20, full, window 20] (8k positions): the KV layout has three groups of one layer
    each, so a block spans one layer (a third of a one-table block). A 4,096-token prompt (64-token chunks) beside a
    short one in a 290-block pool (a one-table layout would need 3 x 257 layer-blocks): at every step its full group
    holds every block of its context, each window group at most ceil((20 - 1 + 64) / 16) + 1 = 7; tokens equal
    transformers' greedy ones; the pool is whole at the end; /metrics counts the window groups' given-back blocks."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model
    from pagedserve.sampling_params import SamplingParams

    hf = save_random_checkpoint(hf_config("gemma3", max_position_embeddings=8192), tmp_path)
    src = ModelSource.resolve(str(tmp_path))
    cfg = src.load_config()
    engine = _engine(build_model(src, cfg, torch.float32, "cpu"), cfg, num_kv_blocks=290)
    kv, window = engine.kv_cache, 20
    assert kv.group_windows == (None, window, window)
    worker = engine.executor.worker
    assert worker.kv_layout.layers_per_group == 1 and worker.block_bytes == 2 * BLOCK * 2 * 16 * 4
    assert len({id(c[0]) for c in worker.kv_caches}) == 1   # the three layers share one K tensor (one per slot)
    rng = random.Random(6)
    prompts = {"long": rng.choices(range(2, 256), k=4096), "short": rng.choices(range(2, 256), k=50)}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out, most_window, full_ok = {rid: [] for rid in prompts}, 0, True
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
        for r in engine.scheduler.running:
            full, *windows = _held_per_group(engine, r)
            full_ok &= full == -(-r.num_computed_tokens // BLOCK) or full == len(r.blocks) // 3
            most_window = max([most_window] + windows)
    assert full_ok and most_window <= -(-(window - 1 + CHUNK) // BLOCK) + 1
    assert kv.num_free_blocks == kv.num_blocks
    freed = kv.num_window_freed_blocks
    assert 2 * (257 - 3) <= freed <= 2 * (257 + 4)   # both window groups of the long request, and the short's
    assert f'pagedserve:kv_blocks_freed_behind_window_total{{model_name="m"}} {float(freed)}' in _metrics_text(engine)
    assert out == {rid: hf_greedy(hf, ids, 6) for rid, ids in prompts.items()}


def test_hybrid_prefix_cache_hit_is_exact(tmp_path):
    """Qwen2 with windows from layer 1 on (layer 0 full): the same 600-token prompt twice in a pool that keeps the
    given-back window blocks cached: the second run hits (>= 500 tokens, every group's blocks found) and gives the
    first run's tokens; in a pool too small to keep them, a miss, the same tokens."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    save_random_checkpoint(hf_config("qwen2-window", max_position_embeddings=2048), tmp_path)
    src = ModelSource.resolve(str(tmp_path))
    cfg = src.load_config()
    model = build_model(src, cfg, torch.float32, "cpu")
    prompt = random.Random(7).choices(range(2, 256), k=600)
    big = _engine(model, cfg, num_kv_blocks=200)
    assert big.kv_cache.group_windows == (None, 40, 40)
    first, _ = _run(big, {"p": prompt}, 5)
    big.kv_cache.reset_stats()
    again, _ = _run(big, {"p2": prompt}, 5)
    assert big.kv_cache.stats.hits_tokens >= 500 and again["p2"] == first["p"]
    small = _engine(model, cfg, num_kv_blocks=60)
    _run(small, {"p": prompt}, 5)
    small.kv_cache.reset_stats()
    miss, _ = _run(small, {"p2": prompt}, 5)
    assert small.kv_cache.stats.hits_tokens < 100 and miss["p2"] == first["p"]
    assert small.kv_cache.num_free_blocks == small.kv_cache.num_blocks
