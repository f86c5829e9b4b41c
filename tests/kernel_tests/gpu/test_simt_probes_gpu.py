"""The host emulator against the hardware: the probe kernels of tests/simt/probes.cu (mma.m16n8k16 in f16 and
bf16, ldmatrix with and without .trans, warp and block reductions, cp.async with zero-fill) run on the GPU through
NVRTC and on the emulator; their outputs must agree. This is what makes the emulator's CPU results in make test
(tests/kernel_tests/test_kernels_simt.py) stand for the GPU's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simt import PROBE_NAMES, Probes, probe_source, unavailable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
cupy = pytest.importorskip("cupy")
if unavailable():
    pytest.skip(unavailable(), allow_module_level=True)

from pagedserve import kernels  # noqa: E402


@pytest.fixture(scope="module")
def gpu_module():
    return cupy.RawModule(code=probe_source(), options=kernels.nvrtc_options(), name_expressions=PROBE_NAMES)


@pytest.fixture(scope="module")
def emulator():
    return Probes()


def run_both(gpu_module, emulator, name, block, make_args, outputs, smem_bytes=0):
    """``make_args(device)`` returns the argument tensors/scalars; ``outputs`` indexes the tensors to compare.
    Returns (gpu outputs, emulator outputs) as CPU tensors."""
    results = []
    for device in ("cuda", "cpu"):
        args = make_args(device)
        raw = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
        if device == "cuda":
            with cupy.cuda.Device(torch.cuda.current_device()):
                gpu_module.get_function(name)((1, 1, 1), block, raw, shared_mem=smem_bytes)
            torch.cuda.synchronize()
        else:
            emulator.launch(name, (1, 1, 1), block, raw, smem_bytes)
        results.append([args[i].cpu() for i in outputs])
    return results


@pytest.mark.parametrize("dtype,name", [(torch.float16, "probe_mma<__half>"),
                                        (torch.bfloat16, "probe_mma<__nv_bfloat16>")], ids=["f16", "bf16"])
def test_mma_matches_gpu(gpu_module, emulator, dtype, name):
    gen = torch.Generator().manual_seed(1)
    a, bt, c = (torch.randn(16, 16, generator=gen).to(dtype), torch.randn(8, 16, generator=gen).to(dtype),
                torch.randn(16, 8, generator=gen))
    gpu, emu = run_both(gpu_module, emulator, name, (32, 1, 1),
                        lambda dev: (torch.full((16, 8), float("nan"), device=dev), a.to(dev), bt.to(dev), c.to(dev)),
                        outputs=[0])
    torch.testing.assert_close(emu[0], gpu[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trans", ["false", "true"])
def test_ldmatrix_matches_gpu(gpu_module, emulator, trans):
    tile = torch.randint(-30000, 30000, (32, 8), dtype=torch.int16)
    gpu, emu = run_both(gpu_module, emulator, f"probe_ldmatrix<{trans}>", (32, 1, 1),
                        lambda dev: (torch.zeros(128, dtype=torch.int32, device=dev), tile.to(dev)), outputs=[0],
                        smem_bytes=512)
    assert torch.equal(emu[0], gpu[0])


def test_reductions_match_gpu(gpu_module, emulator):
    x = torch.randn(256)
    gpu, emu = run_both(gpu_module, emulator, "probe_reduce", (256, 1, 1),
                        lambda dev: (torch.zeros(256, device=dev), torch.zeros(256, device=dev), x.to(dev)),
                        outputs=[0, 1])
    for g, e in zip(gpu, emu):
        torch.testing.assert_close(e, g, atol=1e-5, rtol=1e-5)


def test_cp_async_matches_gpu(gpu_module, emulator):
    src = torch.randint(-2**31, 2**31 - 1, (128,), dtype=torch.int32)
    gpu, emu = run_both(gpu_module, emulator, "probe_cp_async", (32, 1, 1),
                        lambda dev: (torch.zeros(128, dtype=torch.int32, device=dev), src.to(dev), np.int32(1)),
                        outputs=[0], smem_bytes=512)
    assert torch.equal(emu[0], gpu[0])


def test_shuffle_segments_match_gpu(gpu_module, emulator):
    x = torch.randn(32)
    gpu, emu = run_both(gpu_module, emulator, "probe_shfl_segments", (32, 1, 1),
                        lambda dev: (torch.zeros(32, device=dev), torch.zeros(32, device=dev), x.to(dev)),
                        outputs=[0, 1])
    assert all(torch.equal(e, g) for g, e in zip(gpu, emu))
