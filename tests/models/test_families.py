"""Every registered decoder family against HF transformers' own forward, on tiny seeded random checkpoints written
by ``save_pretrained`` and loaded the way ``--model DIR`` loads them (3 layers, GQA 4/2 heads, raised init scale so
greedy margins are clear): logits within float32 tolerance on a 200-token prefill and greedy tokens identical through
the engine (four prompts batched, chunked prefill at 64 tokens), on the torch and the cpu attention backends.
Rope variants (llama3, linear, dynamic, yarn, longrope with partial rotary) are families of their own here."""
from __future__ import annotations

import random

import pytest
import torch

from family_cases import FAMILIES, engine_greedy, hf_config, hf_greedy, save_random_checkpoint


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
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    if any(windows) and backend == "torch":  # the prompt reaches past the windows: without them the logits differ
        try:
            for layer in model.layers:
                layer.self_attn.sliding_window = None
            full = model.compute_logits(prefill_hidden(model, ids, _backend(backend)))
        finally:
            for layer, window in zip(model.layers, windows):
                layer.self_attn.sliding_window = window
        assert (full - ref).abs().max() > 0.5
    attn = [layer.self_attn for layer in model.layers]
    if backend == "torch" and (model.spec.attn_softcap or model.spec.attention_sinks):
        # soft-capping and sinks change these models' logits: running without them differs from transformers
        saved = [(a.softcap, a.sinks.data.clone() if model.spec.attention_sinks else None) for a in attn]
        try:
            for a in attn:
                a.softcap = None
                if model.spec.attention_sinks:
                    a.sinks.data.fill_(-1e30)   # exp(sink) = 0: no sink term
            plain = model.compute_logits(prefill_hidden(model, ids, _backend(backend)))
        finally:
            for a, (cap, sinks) in zip(attn, saved):
                a.softcap = cap
                if sinks is not None:
                    a.sinks.data.copy_(sinks)
        assert (plain - ref).abs().max() > 0.5



@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_through_engine_matches_transformers(family, backend):
    """Four prompts at once (more tokens than one step's budget: chunked prefill), greedy, 6 tokens each."""
    from backend_cases import word_tokenizer
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    label, hf, model, cfg = family
    cap, max_tokens = _prompt_cap(model), 6
    rng = random.Random(2)
    prompts = [rng.choices(range(2, 256), k=min(n, cap - max_tokens)) for n in (7, 45, 130, 260)]
    config = EngineConfig(device="cpu", dtype="float32", attention_backend=backend, num_kv_blocks=200,
                          max_num_batched_tokens=64, max_num_seqs=8)
    engine, info = build_engine(config, model=model, tokenizer=word_tokenizer(256), hf_config=cfg,
                                backend=_backend(backend))
    assert info.max_model_len == min(cap, 512)
    # what GetModelInfo reports of the model, against the HF config
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if getattr(cfg, "sliding_window", None)
                                                   else "full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or 0
    want = tuple(window if t == "sliding_attention" else 0 for t in types)
    want = want if any(want) and (label.endswith("-window") or "sliding_window" in FAMILIES[label][1]) else ()
    assert info.sliding_windows == want
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    assert (info.num_experts, info.num_experts_per_token) == (experts, getattr(cfg, "num_experts_per_tok", 0) if
                                                              experts else 0)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (3, 2, model.head_dim)
    out = engine_greedy(engine, prompts, max_tokens)
    assert out == {f"r{i}": hf_greedy(hf, ids, max_tokens) for i, ids in enumerate(prompts)}
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """``trained_checkpoint(label) -> (HF model, directory)``: the family's tiny checkpoint trained briefly on a
    bigram language (family_cases.train_briefly: predictions with a trained model's margins), made once."""
    made = {}

    def get(label: str):
        if label not in made:
            path = tmp_path_factory.mktemp(f"trained-{label}")
            made[label] = save_random_checkpoint(hf_config(label), path, train_steps=400), str(path)
        return made[label]

    return get


@pytest.mark.parametrize("label", ["qwen3", "qwen3-moe"])
def test_int4_teacher_forced_top1_against_dequantized(trained_checkpoint, label):
    """Weights quantized to int4 at load, experts included, run on pagedserve's CPU kernels with the served
    defaults (``--linear-kernels auto``): top-1 of a 400-token teacher-forced
    prefill (8 random tokens, then 392 of the model's own greedy text) agrees on >= 99% of positions with the same
    int4 weights run by torch's kernels (the dequantized model)."""
    from support import prefill_hidden

    from pagedserve.kernels.cpu_build import cpu_kernel_ops
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.moe import SparseMoeBlock
    from pagedserve.models.registry import build_model

    if cpu_kernel_ops() is None:
        pytest.skip("pagedserve's CPU kernels did not build here")
    kernels = "auto"
    hf, path = trained_checkpoint(label)
    src = ModelSource.resolve(path)
    cfg = src.load_config()
    ids = random.Random(3).choices(range(2, 256), k=8)
    with torch.no_grad():  # continue greedily in the model's own language
        for _ in range(392):
            ids.append(int(hf(torch.tensor([ids[-64:]])).logits[0, -1].argmax()))
    top = {}
    for run in ("torch", kernels):
        model = build_model(src, cfg, torch.float32, "cpu", quantization="int4", linear_kernels=run)
        assert "int4" in model.quantization
        assert model.linear_kernels == ("torch" if run == "torch" else "pagedserve-cpu")
        if label.endswith("moe"):
            block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
            assert "Int4" in type(block.experts[0].down_proj).__name__
        top[run] = model.compute_logits(prefill_hidden(model, ids)).argmax(-1)
    agree = (top[kernels] == top["torch"]).float().mean().item()
    print(f"\n{label} {kernels}: int4 top-1 agreement with the dequantized model {agree:.4f}")
    assert agree >= 0.99


@pytest.mark.parametrize("label,overrides", [("qwen3", {}), ("gpt-oss", {}), ("olmo2", {}),
                                             ("olmo2", {"num_key_value_heads": 1})])
def test_tensor_parallel_2_equals_1(tmp_path, label, overrides):
    """Two spawned ranks (gloo) give the logits of one: Qwen3's per-head q/k norms on each rank's heads; gpt-oss's
    experts sliced on every rank (router bias, expert biases on rank 0, clamped SwiGLU per slice, one all-reduce
    of the summed experts) and its sinks split with the heads; OLMo 2's q/k RMSNorm over the whole projection
    from each rank's slice (the sum of squares all-reduced; one KV head replicated on both ranks counted once)."""
    from tp_cases import run_group

    save_random_checkpoint(hf_config(label, **overrides), tmp_path)
    ids = random.Random(4).choices(range(2, 256), k=90)
    one = torch.tensor(run_group(1, "checkpoint_prefill_logits", str(tmp_path), ids)[0])
    two = run_group(2, "checkpoint_prefill_logits", str(tmp_path), ids)
    assert two[1] is None
    torch.testing.assert_close(torch.tensor(two[0]), one, atol=2e-5, rtol=1e-5)
    assert torch.equal(torch.tensor(two[0]).argmax(-1), one.argmax(-1))
