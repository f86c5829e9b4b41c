// Probe kernels for the host emulator's own tests: each exercises one emulated primitive through the same
// pagedserve:: wrappers the kernels use (cuda/common.cuh is prepended). tests/kernel_tests/test_simt_emulator.py runs
// them on the emulator against the PTX ISA's documented layouts; tests/kernel_tests/gpu/test_simt_probes_gpu.py runs them
// on a GPU and on the emulator and compares, which checks the emulator against the hardware.

// One warp: D[16][8] = A[16][16] B[16][8] + C[16][8] with a single mma.m16n8k16, fragments loaded straight from
// global memory per the PTX ISA layouts. a: row-major [16][16]; b: [8][16] (B transposed, i.e. B column-major);
// c, d: row-major [16][8] fp32.
template <typename T>
__global__ void probe_mma(float* d, const T* a, const T* b, const float* c) {
  using namespace pagedserve;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  auto pair = [](const T* p) { return pack2<T>(to_float(p[0]), to_float(p[1])); };
  const unsigned int ra[4] = {pair(a + g * 16 + 2 * t), pair(a + (g + 8) * 16 + 2 * t), pair(a + g * 16 + 2 * t + 8),
                              pair(a + (g + 8) * 16 + 2 * t + 8)};
  const unsigned int b0 = pair(b + g * 16 + 2 * t), b1 = pair(b + g * 16 + 2 * t + 8);
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  mma_16816<T>(acc, ra, b0, b1);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// One warp: four 8x8 b16 matrices, tile rows 0-7 = matrix 0, ..., 24-31 = matrix 3 (8 elements a row), staged in
// shared memory; lane l gives the address of tile row l. out[lane * 4 + i] = register i of that lane.
template <bool TRANS>
__global__ void probe_ldmatrix(unsigned int* out, const uint4* tile) {
  using namespace pagedserve;
  extern __shared__ uint4 probe_smem[];
  const int lane = threadIdx.x;
  probe_smem[lane] = tile[lane];
  __syncthreads();
  unsigned int r[4];
  if (TRANS) ldmatrix_x4_trans(r, probe_smem + lane);
  else ldmatrix_x4(r, probe_smem + lane);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// One block: out[i] = the warp's sum of in[] (butterfly), then the block's sum (block_sum).
__global__ void probe_reduce(float* warp_out, float* block_out, const float* in) {
  using namespace pagedserve;
  __shared__ float scratch[32];
  const float v = in[threadIdx.x];
  warp_out[threadIdx.x] = warp_sum_range<1, 32>(v);
  block_out[threadIdx.x] = block_sum(v, scratch);
}

// One warp stages 32 x 16 bytes with cp.async; with `wait_first` it waits before reading them back, without it
// it reads first (a bug the emulator must expose: copies land only at the wait).
__global__ void probe_cp_async(uint4* out, const uint4* in, int wait_first) {
  using namespace pagedserve;
  extern __shared__ uint4 probe_smem[];
  const int lane = threadIdx.x;
  cp_async_16(probe_smem + lane, in + lane, lane % 2 == 0);  // odd lanes: zero-fill
  cp_async_commit();
  if (wait_first) cp_async_wait<0>();
  out[lane] = probe_smem[lane];
  cp_async_wait<0>();
}

// Lanes 0-15 of each warp shuffle while lanes 16-31 wait at a block barrier: a hang on hardware.
__global__ void probe_divergent(float* out) {
  if ((threadIdx.x & 31) < 16) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  __syncthreads();
}

// Writes one uint4 past the end of the dynamic shared memory it was given (n uint4).
__global__ void probe_smem_overrun(int n) {
  extern __shared__ uint4 probe_smem[];
  if (threadIdx.x == 0) probe_smem[n] = make_uint4(1, 2, 3, 4);
}

// Thread 0 publishes a value through shared memory and every thread reads it with no barrier in between: a race.
// In thread order every reader comes after thread 0 and the race stays hidden; another order exposes it.
__global__ void probe_missing_barrier(float* out, float value) {
  extern __shared__ float probe_smem_f[];
  if (threadIdx.x == 0) probe_smem_f[0] = value;
  out[blockIdx.x * blockDim.x + threadIdx.x] = probe_smem_f[0];
}

// Shuffles within 8-lane segments: xor_out = shfl_xor(v, 16, width 8) (a source past the caller's segment gives
// the caller's own value: lanes 0-7 keep theirs, lanes 16-23 read lanes 0-7), idx_out = shfl(v, 5, width 8).
__global__ void probe_shfl_segments(float* xor_out, float* idx_out, const float* in) {
  const float v = in[threadIdx.x];
  xor_out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 16, 8);
  idx_out[threadIdx.x] = __shfl_sync(0xffffffffu, v, 5, 8);
}

// The first warp waits at one __syncthreads, the second at another: undefined behaviour in CUDA.
__global__ void probe_split_barrier(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}
