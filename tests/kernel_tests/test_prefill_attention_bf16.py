"""bfloat16 prefill attention on the cpu backend (attention/cpu.py ``prefill_dtype``,
``use_bf16_prefill_attention``): prefill rows within bf16 tolerance of the float32 reference, decode rows of the same
step bit for bit the float32 ones (they stay on the C++ kernel), the KV cache written identically; and which
models get it (approximate prefill numerics already: int8 activations) and which do not. Accuracy on a real model:
tests/models/test_quant.py ("served")."""
from __future__ import annotations

import pytest
import torch

from paged_batch import ATTN_TOL, blocks_needed, make_caches, make_meta, random_qkv
from pagedserve.attention.cpu import (CpuAttentionBackend, bf16_matmul_available, cpu_decode_kernel_available,
                                      use_bf16_prefill_attention)
from pagedserve.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not cpu_decode_kernel_available(), reason="the C++ CPU kernels did not load")

H, HKV, D, BS = 8, 2, 64, 16


@pytest.mark.parametrize("context_lens, query_lens", [
    ([300], [300]),                    # one whole prompt (keys read from the new rows)
    ([50, 77, 200, 130], [1, 1, 64, 130]),   # decodes first, a chunk over a cached prefix, a whole prompt
])
def test_bf16_prefill_rows_close_decode_rows_exact(context_lens, query_lens):
    num_blocks = blocks_needed(context_lens, BS) + 4
    meta = make_meta(context_lens, query_lens, BS, num_blocks, "cpu", seed=1)
    q, k, v = random_qkv(sum(query_lens), H, HKV, D, torch.float32, "cpu", seed=2)
    outs, caches = [], []
    for backend in (CpuAttentionBackend(), CpuAttentionBackend(prefill_dtype=torch.bfloat16), TorchAttentionBackend()):
        kc, vc = make_caches(num_blocks, BS, HKV, D, torch.float32, "cpu", seed=3)
        outs.append(backend.forward(q, k, v, kc, vc, meta, D ** -0.5))
        caches.append((kc, vc))
    exact, bf16, ref = outs
    nd = meta.num_decode_seqs
    assert torch.equal(bf16[:nd], exact[:nd])                       # decode rows: the C++ kernel either way
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    atol, rtol = ATTN_TOL[torch.bfloat16]
    assert torch.allclose(bf16[nd:], ref[nd:], atol=atol, rtol=rtol)
    assert not torch.equal(bf16[nd:], exact[nd:])                   # it did run in bf16


class _Model:
    def __init__(self, a8_min_tokens: int):
        self.a8_min_tokens = a8_min_tokens


def test_which_models_get_bf16_prefill_attention():
    backend = CpuAttentionBackend()
    assert use_bf16_prefill_attention(backend, _Model(16)) == bf16_matmul_available()
    assert backend.prefill_dtype == (torch.bfloat16 if bf16_matmul_available() else None)
    exact = CpuAttentionBackend()
    assert not use_bf16_prefill_attention(exact, _Model(0)) and exact.prefill_dtype is None   # float activations
    assert not use_bf16_prefill_attention(TorchAttentionBackend(), _Model(16))               # the reference
