// Host-compiler stand-in for the CUDA toolkit's crt/host_defines.h (which the nvidia-cuda-runtime wheel does not
// ship): the execution-space and alignment macros that vector_types.h, cuda_fp16.h and cuda_bf16.h use, for
// compiling those headers and the kernels of cuda/ with g++ in the host emulator (tests/simt/simt_host.hpp).
#pragma once
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __inline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __align__(n)
#define __cudart_builtin__
#define __device_builtin__
#define CUDARTAPI
