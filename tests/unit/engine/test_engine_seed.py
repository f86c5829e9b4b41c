"""``--seed`` (EngineConfig.seed) seeds the sampler's generator shared by requests without a seed of their own: two
engines with the same server seed sample the same unseeded tokens, another seed samples others."""
from __future__ import annotations

import torch

import backend_cases as bc
from support import run_to_completion


def _sample(model, cfg, tokenizer, seed):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=64, seed=seed)
    engine, _ = build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg)
    params = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 17, 99], params)
    return {rid: out[0][0] for rid, out in run_to_completion(engine).items()}


def test_server_seed_makes_unseeded_sampling_reproducible():
    shape = dict(bc.SMOLLM_SHAPE, num_hidden_layers=1, vocab_size=512, intermediate_size=128, hidden_size=576)
    model, cfg, tokenizer = bc.random_llama(torch.device("cpu"), **shape)
    first, again, other = (_sample(model, cfg, tokenizer, s) for s in (7, 7, 8))
    assert first == again
    assert first != other
