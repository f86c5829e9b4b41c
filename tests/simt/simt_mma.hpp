// simt_mma.hpp: the tensor-core warp operations ldmatrix.x4 and mma.m16n8k16 (f16, bf16) for the host emulator (part
// of simt_host.hpp, which says what is emulated), as warp collectives with the PTX ISA fragment layouts.
#pragma once

#include <cstdint>
#include <cstring>

#include "simt_sync.hpp"

namespace simt {

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give the row addresses of matrix i. Without
// .trans lane l receives row l/4, elements 2(l%4) and 2(l%4)+1 of each matrix; with .trans, column l/4, rows 2(l%4)
// and 2(l%4)+1. The lower-indexed element is in the low 16 bits.
inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* p, bool trans) {
  check_smem(p, 16, "ldmatrix");
  Block& b = *g_block;
  const int lane = b.cur->lane;
  Warp& w = b.warps[b.cur->warp];
  if (w.size != kWarpSize) fail("ldmatrix: needs a full warp");
  w.addr[lane] = p;
  auto elem = [](const Warp& w, int matrix, int row, int col) -> std::uint32_t {
    return static_cast<const std::uint16_t*>(w.addr[8 * matrix + row])[col];
  };
  if (!trans) {
    warp_collective(Op::kLdmatrix, [&](Warp& w) {
      for (int l = 0; l < kWarpSize; ++l)
        for (int i = 0; i < 4; ++i)
          w.out[l][i] = elem(w, i, l >> 2, 2 * (l & 3)) | (elem(w, i, l >> 2, 2 * (l & 3) + 1) << 16);
    });
  } else {
    warp_collective(Op::kLdmatrixTrans, [&](Warp& w) {
      for (int l = 0; l < kWarpSize; ++l)
        for (int i = 0; i < 4; ++i)
          w.out[l][i] = elem(w, i, 2 * (l & 3), l >> 2) | (elem(w, i, 2 * (l & 3) + 1, l >> 2) << 16);
    });
  }
  for (int i = 0; i < 4; ++i) r[i] = w.out[lane][i];
}

inline float half_bits_to_float(std::uint32_t bits) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(bits);
  return __half2float(__half(raw));
}
inline float bf16_bits_to_float(std::uint32_t bits) {
  const std::uint32_t u = bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, D = A B + C, with the PTX ISA fragment layouts
// (g = lane / 4, t = lane % 4): A registers a[0..3] hold A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..];
// B registers b0, b1 hold B[2t..2t+1][g], B[2t+8..2t+9][g]; C/D hold C[g][2t..2t+1], C[g+8][2t..2t+1].
// Products are exact in fp32 and summed in fp32, k in order.
inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1, bool bf16) {
  Block& b = *g_block;
  const int lane = b.cur->lane;
  Warp& w = b.warps[b.cur->warp];
  if (w.size != kWarpSize) fail("mma: needs a full warp");
  for (int i = 0; i < 4; ++i) w.in[lane][i] = a[i];
  w.in[lane][4] = b0;
  w.in[lane][5] = b1;
  std::memcpy(&w.in[lane][6], d, 16);
  auto compute = [bf16](Warp& w) {
    float A[16][16], B[16][8], C[16][8];
    auto to_f = [bf16](std::uint32_t bits) { return bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits); };
    auto lo = [&](std::uint32_t v) { return to_f(v & 0xffff); };
    auto hi = [&](std::uint32_t v) { return to_f(v >> 16); };
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l >> 2, t = l & 3;
      const std::uint32_t* in = w.in[l];
      A[g][2 * t] = lo(in[0]);         A[g][2 * t + 1] = hi(in[0]);
      A[g + 8][2 * t] = lo(in[1]);     A[g + 8][2 * t + 1] = hi(in[1]);
      A[g][2 * t + 8] = lo(in[2]);     A[g][2 * t + 9] = hi(in[2]);
      A[g + 8][2 * t + 8] = lo(in[3]); A[g + 8][2 * t + 9] = hi(in[3]);
      B[2 * t][g] = lo(in[4]);         B[2 * t + 1][g] = hi(in[4]);
      B[2 * t + 8][g] = lo(in[5]);     B[2 * t + 9][g] = hi(in[5]);
      float c[4];
      std::memcpy(c, &in[6], 16);
      C[g][2 * t] = c[0]; C[g][2 * t + 1] = c[1]; C[g + 8][2 * t] = c[2]; C[g + 8][2 * t + 1] = c[3];
    }
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 8; ++n) {
        float acc = C[m][n];
        for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
        C[m][n] = acc;
      }
    for (int l = 0; l < kWarpSize; ++l) {
      const int g = l >> 2, t = l & 3;
      const float c[4] = {C[g][2 * t], C[g][2 * t + 1], C[g + 8][2 * t], C[g + 8][2 * t + 1]};
      std::memcpy(w.out[l], c, 16);
    }
  };
  warp_collective(bf16 ? Op::kMmaBf16 : Op::kMmaF16, compute);
  std::memcpy(d, w.out[lane], 16);
}

}  // namespace simt
