"""The CPU attention backend (attention/cpu.py): decodes on the C++ paged-attention kernel, prefill chunks on the
torch reference; checked against the reference backend on mixed steps (GQA and MHA, contexts across block
boundaries, scattered blocks), and the kernel's argument checks."""
from __future__ import annotations

import pytest
import torch

from pagedserve.attention import select_attention_backend
from pagedserve.attention.cpu import CpuAttentionBackend, cpu_decode_kernel_available
from pagedserve.attention.torch_ref import TorchAttentionBackend
from paged_batch import make_meta, random_qkv
from support import run_to_completion

pytestmark = pytest.mark.skipif(not cpu_decode_kernel_available(), reason="CPU kernels unavailable")

CASES = [  # (context lens, query lens, heads, kv heads, head_dim, block size)
    ([1, 17, 300, 16], [1, 1, 1, 1], 9, 3, 64, 16),           # decodes only, GQA 3, a context of one token
    ([45, 7, 33, 20], [1, 1, 33, 5], 4, 4, 32, 8),            # decodes then a whole prompt and a chunk, MHA
    ([129, 64], [1, 64], 8, 2, 16, 32),                       # one decode and one prefill, GQA 4
]


def _mixed_step(case: int):
    """Case ``case`` of CASES as ``(metadata, [k_cache, v_cache], (q, k, v), the generator that made the caches)``,
    float32 on CPU."""
    ctx, qlens, h, hkv, d, bs = CASES[case]
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    meta = make_meta(ctx, qlens, bs, num_blocks, "cpu", seed=case)
    gen = torch.Generator().manual_seed(case)
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen) for _ in range(2)]
    return meta, caches, random_qkv(sum(qlens), h, hkv, d, torch.float32, "cpu", seed=case), gen


@pytest.mark.parametrize("window", [None, 1, 6, 40])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_backend(case, window):
    """Mixed steps, full attention and sliding windows (one key, inside a block, across blocks)."""
    meta, caches, (q, k, v), gen = _mixed_step(case)
    h, d = q.shape[1], q.shape[2]
    ref_caches = [c.clone() for c in caches]
    ref = TorchAttentionBackend().forward(q, k, v, *ref_caches, meta, d ** -0.5, window)
    got = CpuAttentionBackend().forward(q, k, v, *caches, meta, d ** -0.5, window)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])  # the same KV writes
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_softcap_and_sinks_match_reference_backend(case, window):
    """Gemma 2's soft-capped scores and gpt-oss's sink logits, alone and together: the C++ decode rows and the
    reference's prefill rows against the reference backend."""
    meta, caches, (q, k, v), gen = _mixed_step(case)
    h, d = q.shape[1], q.shape[2]
    sinks = torch.randn(h, generator=gen) * 2
    for softcap, sink in ((1.5, None), (None, sinks), (0.7, sinks)):
        ref_caches, got_caches = [c.clone() for c in caches], [c.clone() for c in caches]
        ref = TorchAttentionBackend().forward(q, k, v, *ref_caches, meta, d ** -0.5, window, softcap=softcap,
                                              sinks=sink)
        plain = TorchAttentionBackend().forward(q, k, v, *[c.clone() for c in caches], meta, d ** -0.5, window)
        got = CpuAttentionBackend().forward(q, k, v, *got_caches, meta, d ** -0.5, window, softcap=softcap,
                                            sinks=sink)
        assert (got - ref).abs().max().item() < 1e-5, (softcap, sink is not None)
        assert (plain - ref).abs().max().item() > 1e-2   # the options change the result


SPLIT_CASES = [  # (context lens, heads, kv heads, head_dim, block size, cache dtype)
    ([1000], 9, 3, 64, 16, torch.float32),          # one long request (the one-stream case): 4+ splits
    ([700, 37], 9, 3, 64, 16, torch.float32),       # unequal lengths: the short one's later splits are empty
    ([200], 4, 1, 32, 64, torch.float32),           # chunks rounded to 64-row blocks: 3 splits, the last empty
    ([513, 64, 1], 8, 2, 128, 16, torch.bfloat16),  # head_dim 128, a bf16 cache
]


@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
def test_decode_kernel_context_splits_match_float64(case):
    """Few requests with long contexts: the kernel cuts each context into splits (flash-decoding) and merges them.
    Every split count (the kernel's choice, none, a cap of 3, 7) agrees with a float64 softmax over the gathered
    context within float32 rounding, with no window and with sliding windows (the splits cut the window's rows)."""
    ctx, h, hkv, d, bs, dtype = SPLIT_CASES[case]
    gen = torch.Generator().manual_seed(40 + case)
    max_blocks = max(-(-c // bs) for c in ctx)
    num_blocks = len(ctx) * max_blocks + 2
    tables = torch.randperm(num_blocks, generator=gen)[:len(ctx) * max_blocks].view(len(ctx), max_blocks)
    tables = tables.to(torch.int32).contiguous()
    k_cache, v_cache = (torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(len(ctx), h, d, generator=gen) * 2
    lens = torch.tensor(ctx, dtype=torch.int32)
    op = torch.ops.pagedserve_cpu.paged_decode_attention
    sinks = torch.randn(h, generator=gen) * 3
    for window, softcap, sink in ((0, 0.0, None), (1, 0.0, None), (100, 0.0, None), (333, 0.0, None),
                                  (0, 2.0, None), (0, 0.0, sinks), (100, 2.0, sinks)):
        # window 0: no window, else the last `window` rows; softcap 0: none; sink: gpt-oss's per-head sink logit
        want = torch.empty(len(ctx), h, d, dtype=torch.float64)
        for s, n in enumerate(ctx):
            rows = tables[s].long()
            first = max(0, n - window) if window else 0
            k = k_cache[rows].reshape(-1, hkv, d)[first:n].double().repeat_interleave(h // hkv, dim=1)   # [n, h, d]
            v = v_cache[rows].reshape(-1, hkv, d)[first:n].double().repeat_interleave(h // hkv, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * d ** -0.5
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            if sink is not None:
                scores = torch.cat([scores, sink.double()[:, None]], dim=1)
            p = torch.softmax(scores, dim=-1)[:, :n - first]
            want[s] = torch.einsum("hn,nhd->hd", p, v)
        for max_splits in (0, 1, 3, 7):
            got = op(q, k_cache, v_cache, tables, lens, d ** -0.5, max_splits, window, softcap, sink)
            assert (got.double() - want).abs().max().item() < 2e-5, (max_splits, window, softcap, sink is not None)
    with pytest.raises(RuntimeError, match="sliding_window must be >= 0"):
        op(q, k_cache, v_cache, tables, lens, 1.0, 0, -1)
    with pytest.raises(RuntimeError, match="max_splits must be >= 0"):
        op(q, k_cache, v_cache, tables, lens, 1.0, -1)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        op(q, k_cache, v_cache, tables, lens, 1.0, 0, 0, -1.0)
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32"):
        op(q, k_cache, v_cache, tables, lens, 1.0, 0, 0, 0.0, torch.zeros(h + 1))


def test_auto_picks_cpu_backend_and_torch_stays_reference():
    assert isinstance(select_attention_backend("auto", "cpu"), CpuAttentionBackend)
    assert type(select_attention_backend("torch", "cpu")) is TorchAttentionBackend
    with pytest.raises(RuntimeError, match="needs a CPU device"):
        select_attention_backend("cpu", "cuda")


def test_kernel_rejects_bad_block_ids_and_lengths():
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    op = torch.ops.pagedserve_cpu.paged_decode_attention
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, cache, cache, torch.tensor([[5]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        op(q, cache, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 1.0)


def test_kv_write_kernel_matches_reference_and_skips_padding():
    """The C++ reshape_and_cache writes what the torch reference writes: strided value rows (views of a fused QKV
    output), padding rows (slot -1) skipped, every other slot untouched; a slot past the cache raises."""
    from pagedserve.attention.torch_ref import reshape_and_cache

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 2 * 3 * 16 + 64, generator=gen)
    key = qkv[:, 64:112].reshape(5, 3, 16)            # strided rows, like the model's views
    value = qkv[:, 112:].view(5, 3, 16)
    slots = torch.tensor([7, -1, 0, 31, 12])
    caches = [torch.randn(4, 8, 3, 16, generator=gen) for _ in range(2)]
    ref = [c.clone() for c in caches]
    torch.ops.pagedserve_cpu.reshape_and_cache(key, value, *caches, slots)
    reshape_and_cache(key, value, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        torch.ops.pagedserve_cpu.reshape_and_cache(key, value, *caches, torch.tensor([0, 1, 2, 3, 32]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cache_write_rounds_like_torch(dtype):
    """--kv-cache-dtype float16 / bfloat16: the C++ KV write rounds float32 rows exactly as torch's ``.to`` does
    (nearest even; overflow to inf in float16; NaN stays NaN), into the same slots as the reference."""
    from pagedserve.attention.torch_ref import reshape_and_cache

    gen = torch.Generator().manual_seed(4)
    key = torch.randn(6, 3, 16, generator=gen) * torch.tensor([1e-6, 1.0, 3e4]).view(1, 3, 1)
    key[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 7e4])
    value = torch.randn(6, 3, 16, generator=gen)
    value.view(-1)[:8] = torch.tensor([1 + 2 ** -9, 1 + 3 * 2 ** -9, 1 + 2 ** -12, 1 + 3 * 2 ** -12,  # ties
                                       -(1 + 2 ** -9), 65519.0, 2 ** -26, -0.0])
    slots = torch.tensor([7, -1, 0, 31, 12, 5])
    caches = [torch.zeros(4, 8, 3, 16, dtype=dtype) for _ in range(2)]
    ref = [c.clone() for c in caches]
    torch.ops.pagedserve_cpu.reshape_and_cache(key, value, *caches, slots)
    reshape_and_cache(key, value, *ref, slots)
    for got, want in zip(caches, ref):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)) or \
            torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))
    assert caches[0][0, 7, 0, 0].isnan()
    assert torch.equal(caches[1][0, 7, 0].float(), value[0, 0].to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_half_precision_cache_matches_reference_backend(case, dtype):
    """The decode kernel widens a float16 / bfloat16 cache exactly: on the same cache contents it matches the
    reference backend (which reads the cache with ``.to(float32)``) within float32 rounding (under a 6-key
    sliding window), and both write the step's rows identically."""
    ctx, qlens, h, hkv, d, bs = CASES[case]
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    meta = make_meta(ctx, qlens, bs, num_blocks, "cpu", seed=case)
    gen = torch.Generator().manual_seed(case)
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    q, k, v = random_qkv(sum(qlens), h, hkv, d, torch.float32, "cpu", seed=case)
    ref_caches = [c.clone() for c in caches]
    ref = TorchAttentionBackend().forward(q, k, v, *ref_caches, meta, d ** -0.5, 6)
    got = CpuAttentionBackend().forward(q, k, v, *caches, meta, d ** -0.5, 6)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 1e-5


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from pagedserve.sampling_params import SamplingParams

    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = run_to_completion(engine)
    return [out[f"p{i}"][0][0] for i in range(len(prompts))]


def test_float16_kv_cache_engine(llm_parts):
    """--kv-cache-dtype float16 on the embedded model (CPU backend): twice the blocks for the same KV memory, a
    float16 cache, and greedy answers to chat prompts that stay with the float32 cache's (the first 8 tokens equal on
    at least 3 of 4 prompts; identical KV contents are not expected: K/V lose mantissa bits)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    model, tokenizer, cfg = llm_parts
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                             tokenize=True)
               for m in ("What is the capital of France?", "Write a haiku about rain.",
                         "Explain what a compiler does.", "List three colors.")]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    runs = {}
    for kv in ("float32", "float16"):
        config = EngineConfig(device="cpu", dtype="float32", attention_backend="cpu", kv_cache_dtype=kv,
                              kv_cache_memory_bytes=32 << 20, enforce_eager=True)
        engine, info = build_engine(config, model=model, tokenizer=tokenizer, hf_config=cfg)
        runs[kv] = (info, engine.executor.worker.runner.kv_caches[0][0].dtype, _greedy(engine, prompts, 16))
    (info32, dtype32, out32), (info16, dtype16, out16) = runs["float32"], runs["float16"]
    assert (dtype32, dtype16) == (torch.float32, torch.float16)
    assert (info32.kv_cache_dtype, info16.kv_cache_dtype) == ("float32", "float16")
    assert info16.kv_block_bytes * 2 == info32.kv_block_bytes
    assert info16.num_kv_blocks in (2 * info32.num_kv_blocks, 2 * info32.num_kv_blocks + 1)   # floor of 32 MiB / block
    agree = sum(a[:8] == b[:8] for a, b in zip(out32, out16))
    assert agree >= 3, (out32, out16)


def test_kv_cache_dtype_is_checked():
    from pagedserve.config import EngineConfig
    from pagedserve.worker.kv_tensors import kv_cache_dtype

    with pytest.raises(ValueError, match="kv_cache_dtype: unknown value 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.float32, torch.device("cpu")) == torch.bfloat16
    # auto: the model's dtype, but float16 for a float32 model on CPU running a GGUF's quantized weights (llama.cpp's)
    cpu = torch.device("cpu")
    assert kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert kv_cache_dtype("auto", torch.float32, cpu, gguf_quantized=True) == torch.float16
    assert kv_cache_dtype("auto", torch.bfloat16, cpu, gguf_quantized=True) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, torch.device("cuda"), gguf_quantized=True) == torch.float32
    assert kv_cache_dtype("float32", torch.float32, cpu, gguf_quantized=True) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype: float16 differs from the model dtype float32; .* CPU only"):
        kv_cache_dtype("float16", torch.float32, torch.device("cuda"))


@pytest.mark.e2e   # the session server; the rest of this module is kernel-level
def test_model_info_reports_the_kv_cache_dtype(server, client):
    """GetModelInfo.generation.kv_cache_dtype is the cache's element type (the session server, the embedded GGUF
    dequantized with quantization="none": auto -> float32), and the KV layout it reports (SmolLM2-135M: 30 layers, 3
    KV heads of 64, no window, dense) gives kv_block_bytes."""
    info = client.model_info().generation
    assert info.kv_cache_dtype == "float32"
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (30, 3, 64)
    assert list(info.sliding_windows) == [] and (info.num_experts, info.num_experts_per_token) == (0, 0)
    assert info.kv_block_bytes == info.block_size * 2 * 30 * 3 * 64 * 4
    assert server.engine.executor.worker.runner.kv_caches[0][0].dtype == torch.float32
    if info.attention_backend == "cpu" and cpu_decode_kernel_available():   # README, "Deterministic outputs"
        assert info.batch_invariant and "attention: batch-invariant paged attention" in info.kernels
