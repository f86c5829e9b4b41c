// simt_host.hpp: runs the kernels of cuda/ on a CPU, one emulated CUDA thread per fiber, so that make test can
// check their results against the torch reference on a machine without a GPU.
//
// What is emulated (semantics from the CUDA C++ Programming Guide and the PTX ISA, sm_80):
//   - the execution model: a grid of thread blocks; each block's threads run as cooperative fibers on one OS thread
//     (blocks are spread over worker threads); threadIdx / blockIdx / blockDim / gridDim.
//   - __syncthreads (waits for every thread of the block that has not exited; threads waiting at two different
//     __syncthreads statements are reported, as the programming guide makes that undefined), warp collectives
//     (__shfl_sync, __shfl_xor_sync, ldmatrix, mma.sync): an operation runs when every lane of the warp has reached
//     it, on the values all lanes supplied, as the hardware's converged warp does. Lanes of one warp arriving at
//     different collectives, a collective in a warp with an exited lane, or a barrier that can never complete are
//     reported as errors, not hung on.
//   - cp.async: copies are queued per thread and performed when cp.async.wait_group retires their group, the
//     latest moment the PTX ISA allows, so a kernel that reads a staged tile before waiting for it reads garbage;
//     in the shuffled mode (below) each copy instead lands at once with probability 1/2, so a kernel that reissues
//     copies into a buffer other threads may still be reading gets corrupted data.
//   - global reads through __ldg and cp.async are checked to fall inside the storage of a tensor argument (when
//     the launcher registered them: Simulator does).
//   - shared memory, dynamic and static, is filled with 0xff bytes (NaN as fp32/fp16/bf16) at each block's start;
//     ldmatrix and cp.async addresses are checked to lie inside the dynamic part and be 16-byte aligned, and a
//     guard region after it is checked at the block's end.
//   - thread order: between barriers a block's threads run in thread order (seed 0) or, by default from Python, in
//     a seeded pseudo-random order per pass, so results cannot lean on an order the hardware does not promise.
// Not emulated: timing, memory-model races between threads inside one barrier interval beyond what the shuffled
// order exposes (a block's fibers interleave only at barriers and collectives), plain (non-__ldg) global loads and
// stores are not bounds-checked, bank conflicts, register limits (ptxas reports those:
// tests/kernel_tests/test_kernels_compile.py).
//
// The including translation unit defines PAGEDSERVE_SIMT_HOST, includes this file, then the kernel source with
// `extern __shared__ T name[];` rewritten to `T* name = reinterpret_cast<T*>(::simt::dynamic_smem());` and
// `__shared__ T name[N];` to `T* name = ::simt::static_smem<T>(N, <site id>);`
// (tests/simt/__init__.py does both), and defines one extern "C" entry point per kernel instantiation that calls
// simt::launch(&kernel<...>, ...).
//
// The emulator is split by concern, each header including what it builds on:
//   simt_fibers.hpp    block / warp / thread state, the context switch, fail / park / thread exit
//   simt_sync.hpp      __syncthreads, warp collectives and shuffles, shared memory, global-read checks, cp.async
//   simt_mma.hpp       ldmatrix.x4 and mma.m16n8k16 as warp collectives
//   simt_launch.hpp    the per-block scheduler and simt::launch
//   simt_builtins.hpp  the CUDA built-ins and cuda/common.cuh's PTX wrappers (its macros must come last)
// tests/simt/__init__.py hashes every one of them (and include/) into the cache key of a compiled kernel.
#pragma once

#include "simt_fibers.hpp"
#include "simt_sync.hpp"
#include "simt_mma.hpp"
#include "simt_launch.hpp"
#include "simt_builtins.hpp"
