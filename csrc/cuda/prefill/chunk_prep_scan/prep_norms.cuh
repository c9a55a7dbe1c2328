// Stage of the prep kernel: the q and k row norms (the row scales qs = scale / |q|, ks = 1 / |k|
// with the L2 norm, else scale and 1) and the fp32 diagonal of A_qk, before the tiles are scaled in
// place by the gate pass.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"

namespace cula {
namespace chunk_prep_scan {

// KDA (8 warps). Row norms: 4 lanes per row (warp w rows 8w..8w+7), each lane K / 4 channels in
// 16-byte pieces 16c + 8(p & 1) + 64(p >> 1), so the two rows of a quarter warp hit disjoint
// banks; the row scales go to shared memory for the gate pass.
// q_s, k_s: the raw tiles (row stride Ly::LDK); rs_s: [qs per row][ks per row]; qk_s: A_qk's diagonal.
template <int K, class Ly>
__device__ __forceinline__ void kda_row_norms(const FwdParams& p, const bf16* q_s, const bf16* k_s, float* rs_s,
                                              float* qk_s, int warp, int lane) {
  constexpr int LDK = Ly::LDK;
  const int row = 8 * warp + (lane >> 2), c = lane & 3;
  float q2 = 0.0f, k2 = 0.0f, qk = 0.0f;
#pragma unroll
  for (int pc = 0; pc < K / 32; ++pc) {
    const int col = 16 * c + 8 * (pc & 1) + 64 * (pc >> 1);
    const uint4 qv = *reinterpret_cast<const uint4*>(q_s + row * LDK + col);
    const uint4 kv = *reinterpret_cast<const uint4*>(k_s + row * LDK + col);
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(&qv);
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = unpack(qw[j]), b = unpack(kw[j]);
      q2 += a.x * a.x + a.y * a.y;
      k2 += b.x * b.x + b.y * b.y;
      qk += a.x * b.x + a.y * b.y;
    }
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    q2 += __shfl_xor_sync(0xffffffffu, q2, o);
    k2 += __shfl_xor_sync(0xffffffffu, k2, o);
    qk += __shfl_xor_sync(0xffffffffu, qk, o);
  }
  if (c == 0) {
    const float qsr = p.l2norm ? p.scale * rsqrtf(q2 + 1e-6f) : p.scale;
    const float ksr = p.l2norm ? rsqrtf(k2 + 1e-6f) : 1.0f;
    rs_s[row] = qsr, rs_s[kBT + row] = ksr;
    // The diagonal of A_qk in fp32 from the unrounded rows: for short sequences it is most of
    // o, and q.k of two nearly orthogonal rows loses its digits to bf16 rounding of q el and Kr.
    qk_s[row] = qsr * ksr * qk;
  }
}

// GDN and GLA (4 warps): the row norms of this warp's row block bI.. (lanes g, t of the mma layout);
// the row scales go where the family's later stages read them: GDN's q and k row factors (qsc_s,
// ksc_s), GLA's (rowq_s, rowk_s).
template <int K, class F, class Ly>
__device__ __forceinline__ void block_row_norms(const FwdParams& p, const bf16* q_s, const bf16* k_s, float* qk_s,
                                                float* qsc_s, float* ksc_s, float* rowq_s, float* rowk_s, int bI,
                                                int g, int t) {
  constexpr int LDK = Ly::LDK, KS = K / 16;
  float qs[2], ks[2];
  float q2[2] = {0.0f, 0.0f}, k2[2] = {0.0f, 0.0f}, qk[2] = {0.0f, 0.0f};
#pragma unroll 1
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
      const int row = bI + g + 8 * (rr & 1), col = 16 * kk + 2 * t + 8 * (rr >> 1);
      const float2 qv = bf2(q_s + row * LDK + col), kv = bf2(k_s + row * LDK + col);
      q2[rr & 1] += qv.x * qv.x + qv.y * qv.y;
      k2[rr & 1] += kv.x * kv.x + kv.y * kv.y;
      qk[rr & 1] += qv.x * kv.x + qv.y * kv.y;
    }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    q2[x] += __shfl_xor_sync(0xffffffffu, q2[x], 1);
    q2[x] += __shfl_xor_sync(0xffffffffu, q2[x], 2);
    k2[x] += __shfl_xor_sync(0xffffffffu, k2[x], 1);
    k2[x] += __shfl_xor_sync(0xffffffffu, k2[x], 2);
    qk[x] += __shfl_xor_sync(0xffffffffu, qk[x], 1);
    qk[x] += __shfl_xor_sync(0xffffffffu, qk[x], 2);
  }
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    qs[x] = p.l2norm ? p.scale * rsqrtf(q2[x] + 1e-6f) : p.scale;
    ks[x] = p.l2norm ? rsqrtf(k2[x] + 1e-6f) : 1.0f;
    // The diagonal of A_qk in fp32 from the unrounded rows: for short sequences it is most of o,
    // and q.k of two nearly orthogonal rows loses its digits to bf16 rounding of q el and Kr.
    if (t == 0) {
      qk_s[bI + g + 8 * x] = qs[x] * ks[x] * qk[x];
      if (F::kScalarGate) qsc_s[bI + g + 8 * x] = qs[x], ksc_s[bI + g + 8 * x] = ks[x];
      if (!F::kDelta) rowq_s[bI + g + 8 * x] = qs[x], rowk_s[bI + g + 8 * x] = ks[x];
    }
  }
}

}  // namespace chunk_prep_scan
}  // namespace cula
