"""Every registered decoder family against HF transformers' own forward, on tiny seeded random checkpoints written
by ``save_pretrained`` and loaded the way ``--model DIR`` loads them (3 layers, GQA 4/2 heads, raised init scale so
greedy margins are clear): logits within float32 tolerance on a 200-token prefill and greedy tokens identical through
the engine (four prompts batched, chunked prefill at 64 tokens), on the torch and the cpu attention backends.
Rope variants (llama3, linear, dynamic, yarn, longrope with partial rotary) are families of their own here."""
from __future__ import annotations

import random

import pytest
import torch

from family_cases import FAMILIES, hf_config, save_random_checkpoint


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(label, HF model, our model loaded from the saved directory, its config)."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    label = request.param
    path = tmp_path_factory.mktemp(label)
    hf = save_random_checkpoint(hf_config(label), path)
    src = ModelSource.resolve(str(path))
    cfg = src.load_config()
    assert cfg.architectures == [FAMILIES[label][2]]
    return label, hf, build_model(src, cfg, torch.float32, "cpu"), cfg


def _backend(name: str):
    from pagedserve.attention.cpu import CpuAttentionBackend
    from pagedserve.attention.torch_ref import TorchAttentionBackend

    return CpuAttentionBackend() if name == "cpu" else TorchAttentionBackend()


def _prompt_cap(model) -> int:
    return model.max_exact_len or model.config.max_position_embeddings


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_logits_match_transformers(family, backend):
    from support import prefill_hidden

    label, hf, model, _ = family
    n = min(200, _prompt_cap(model))
    ids = random.Random(1).choices(range(2, 256), k=n)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = model.compute_logits(prefill_hidden(model, ids, _backend(backend)))
    torch.testing.assert_close(got, ref, atol=5e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_through_engine_matches_transformers(family, backend):
    """Four prompts at once (more tokens than one step's budget: chunked prefill), greedy, 6 tokens each."""
    from backend_cases import word_tokenizer
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.sampling_params import SamplingParams

    label, hf, model, cfg = family
    cap, max_tokens = _prompt_cap(model), 6
    rng = random.Random(2)
    prompts = [rng.choices(range(2, 256), k=min(n, cap - max_tokens)) for n in (7, 45, 130, 260)]
    config = EngineConfig(device="cpu", dtype="float32", attention_backend=backend, num_kv_blocks=200,
                          max_num_batched_tokens=64, max_num_seqs=8)
    engine, info = build_engine(config, model=model, tokenizer=word_tokenizer(256), hf_config=cfg,
                                backend=_backend(backend))
    assert info.max_model_len == min(cap, 512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    assert out == {f"r{i}": _hf_greedy(hf, ids, max_tokens) for i, ids in enumerate(prompts)}
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
