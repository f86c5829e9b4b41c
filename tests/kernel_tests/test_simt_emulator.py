"""The host emulator (tests/simt) itself: each primitive the kernels use, through the probe kernels of
tests/simt/probes.cu, against the layouts and semantics the PTX ISA documents (mma.m16n8k16 and ldmatrix fragment
layouts, cp.async groups), and its error reports (a divergent warp, a shared-memory overrun). The same probes run
on a GPU and on the emulator in tests/kernel_tests/gpu/test_simt_probes_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import cubin
from simt import PROBE_NAMES, Probes, SimtError, Simulator, unavailable, probe_source

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@pytest.fixture(scope="module")
def probes():
    return Probes()


def ldmatrix_expected(tile: np.ndarray, trans: bool) -> np.ndarray:
    """PTX ISA, ldmatrix .m8n8.x4.b16: register i of lane l holds two elements of matrix i (tile rows 8i..8i+7):
    row l/4, columns 2(l%4) and 2(l%4)+1; with .trans, column l/4, rows 2(l%4) and 2(l%4)+1. Low half first."""
    out = np.zeros((32, 4), dtype=np.uint32)
    for lane in range(32):
        for i in range(4):
            m = tile[8 * i:8 * i + 8].astype(np.uint32)
            a, b = ((m[2 * (lane % 4), lane // 4], m[2 * (lane % 4) + 1, lane // 4]) if trans
                    else (m[lane // 4, 2 * (lane % 4)], m[lane // 4, 2 * (lane % 4) + 1]))
            out[lane, i] = a | (b << 16)
    return out


@pytest.mark.parametrize("dtype,name", [(torch.float16, "probe_mma<__half>"),
                                        (torch.bfloat16, "probe_mma<__nv_bfloat16>")], ids=["f16", "bf16"])
def test_mma_computes_a_times_b_plus_c(probes, dtype, name):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    d = torch.full((16, 8), float("nan"))
    bt = b.t().contiguous()  # the probe reads B column-major
    probes.launch(name, (1, 1, 1), (32, 1, 1), (ptr(d), ptr(a), ptr(bt), ptr(c)))
    expected = a.double() @ b.double() + c.double()
    torch.testing.assert_close(d.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_fragment_layout(probes, trans):
    tile = torch.arange(32 * 8, dtype=torch.int32).to(torch.int16).view(32, 8).contiguous()
    out = torch.zeros(32 * 4, dtype=torch.int32)
    probes.launch(f"probe_ldmatrix<{'true' if trans else 'false'}>", (1, 1, 1), (32, 1, 1), (ptr(out), ptr(tile)),
                  smem_bytes=32 * 16)
    got = out.numpy().view(np.uint32).reshape(32, 4)
    np.testing.assert_array_equal(got, ldmatrix_expected(tile.numpy().view(np.uint16), trans))


def test_warp_and_block_reductions(probes):
    x = torch.randn(128, dtype=torch.float64).float()
    warp_out, block_out = torch.zeros(128), torch.zeros(128)
    probes.launch("probe_reduce", (1, 1, 1), (128, 1, 1), (ptr(warp_out), ptr(block_out), ptr(x)))
    torch.testing.assert_close(warp_out, x.view(4, 32).sum(1).repeat_interleave(32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block_out, x.sum().expand(128), atol=1e-5, rtol=1e-5)


def test_shuffle_segments(probes):
    """PTX shfl.sync: .bfly reads lane ^ mask unless that lies past the end of the caller's segment of `width`
    lanes; .idx reads lane (src mod width) of the caller's segment."""
    x = torch.arange(32, dtype=torch.float32)
    xor_out, idx_out = torch.zeros(32), torch.zeros(32)
    probes.launch("probe_shfl_segments", (1, 1, 1), (32, 1, 1), (ptr(xor_out), ptr(idx_out), ptr(x)))
    lanes = torch.arange(32)
    expected_xor = torch.where((lanes ^ 16) <= (lanes & ~7) + 7, lanes ^ 16, lanes).float()
    assert torch.equal(xor_out, expected_xor)
    assert torch.equal(idx_out, ((lanes & ~7) + 5).float())


def test_cp_async_copies_land_at_wait_group(probes):
    src = torch.arange(32 * 4, dtype=torch.int32)
    out = torch.zeros(32 * 4, dtype=torch.int32)
    probes.launch("probe_cp_async", (1, 1, 1), (32, 1, 1), (ptr(out), ptr(src), np.int32(1)), smem_bytes=512)
    expected = src.view(32, 4).clone()
    expected[1::2] = 0  # predicate false: zero-filled
    assert torch.equal(out.view(32, 4), expected)
    probes.launch("probe_cp_async", (1, 1, 1), (32, 1, 1), (ptr(out), ptr(src), np.int32(0)), smem_bytes=512)
    assert (out == -1).all(), "read before the wait: the emulator's 0xff fill, not the data"


def test_divergent_warp_is_reported_not_hung(probes):
    out = torch.zeros(64)
    with pytest.raises(SimtError, match="deadlock"):
        probes.launch("probe_divergent", (2, 1, 1), (64, 1, 1), (ptr(out),))


def test_threads_at_different_barriers_are_reported(probes):
    with pytest.raises(SimtError, match="different __syncthreads"):
        probes.launch("probe_split_barrier", (1, 1, 1), (64, 1, 1), (ptr(torch.zeros(64)),))


def test_shared_memory_overrun_is_reported(probes):
    probes.launch("probe_smem_overrun", (1, 1, 1), (32, 1, 1), (np.int32(3),), smem_bytes=64)  # in bounds
    with pytest.raises(SimtError, match="past the end of dynamic shared memory"):
        probes.launch("probe_smem_overrun", (1, 1, 1), (32, 1, 1), (np.int32(4),), smem_bytes=64)


def test_thread_order_between_barriers_is_shuffled():
    """A read racing a write with no barrier: thread order hides it (seed 0), the shuffled order (what Simulator
    uses by default) exposes it in some block."""
    out = torch.zeros(8 * 128)
    args = (ptr(out), np.float32(3.0))
    Probes(seed=0).launch("probe_missing_barrier", (8, 1, 1), (128, 1, 1), args, smem_bytes=16)
    assert (out == 3.0).all()
    Probes(seed=1).launch("probe_missing_barrier", (8, 1, 1), (128, 1, 1), args, smem_bytes=16)
    assert torch.isnan(out).any(), "some thread ran before thread 0 and read the 0xff fill"


@pytest.mark.skipif(not kernels.nvrtc_available(), reason="NVRTC or the CUDA headers are not installed")
def test_probes_are_valid_cuda():
    """The probes compile with NVRTC for sm_80, so the GPU comparison can run them unchanged."""
    result = cubin.compile_source_to_cubin(probe_source(), "probes.cu", PROBE_NAMES, "sm_80")
    assert set(result.lowered_names) == set(PROBE_NAMES)


def test_simulator_is_an_installable_kernel_runtime():
    """The emulator implements pagedserve.kernels.KernelRuntime and is installed through use_runtime, for the
    block only; it takes CPU tensors and reports the SM count and architecture the launchers plan with."""
    sim = Simulator(num_sms=7)
    assert isinstance(sim, kernels.KernelRuntime)
    default = kernels.current_runtime()
    with sim.install() as installed:
        assert installed is sim and kernels.current_runtime() is sim
        assert kernels.num_sms(None) == 7 and kernels.device_arch(None) == "simt"
        assert sim.check_device(x=torch.zeros(1)) == torch.device("cpu")
        with pytest.raises(ValueError, match="^x"):
            sim.check_device(x=torch.zeros(1, device="meta"))
    assert kernels.current_runtime() is default
