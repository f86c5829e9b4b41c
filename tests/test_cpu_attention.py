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

pytestmark = pytest.mark.skipif(not cpu_decode_kernel_available(), reason="CPU kernels unavailable")

CASES = [  # (context lens, query lens, heads, kv heads, head_dim, block size)
    ([1, 17, 300, 16], [1, 1, 1, 1], 9, 3, 64, 16),           # decodes only, GQA 3, a context of one token
    ([45, 7, 33, 20], [1, 1, 33, 5], 4, 4, 32, 8),            # decodes then a whole prompt and a chunk, MHA
    ([129, 64], [1, 64], 8, 2, 16, 32),                       # one decode and one prefill, GQA 4
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference_backend(case):
    ctx, qlens, h, hkv, d, bs = CASES[case]
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    meta = make_meta(ctx, qlens, bs, num_blocks, "cpu", seed=case)
    gen = torch.Generator().manual_seed(case)
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen) for _ in range(2)]
    q, k, v = random_qkv(sum(qlens), h, hkv, d, torch.float32, "cpu", seed=case)
    ref_caches = [c.clone() for c in caches]
    ref = TorchAttentionBackend().forward(q, k, v, *ref_caches, meta, d ** -0.5)
    got = CpuAttentionBackend().forward(q, k, v, *caches, meta, d ** -0.5)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])  # the same KV writes
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-5


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
