// One block of the fused kernels' intra-chunk attention A = (q k^T) scaled per pair, shared by
// chunk_fused_kernel (fused.cuh) and its warp-specialised form (fused_ws.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/recurrence_math.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_fused/config.cuh"

namespace cula {
namespace chunk_fused {

// Block (I, Jb) of A for this warp's rows bI.. (I = bI / 16), lower triangle only, in the mma
// C-fragment layout: x[nt][hh][e] = qs_i e^{G_i - G_j} q_i.k_j for row i = bI + g + 8 hh and column
// j = 16 Jb + 8 nt + 2t + e where j <= i, else 0. qf: this warp's q rows as A fragments; k_s: the k
// tile (row stride LDK); F: the chunk's factors (kFP: G_j - ln ks_j per row); gi, qi: G_i and qs_i of
// rows g and g + 8; E: the element type of q and k (bf16 or fp16). Two accumulator chains over the
// k-steps, so the blocks of a warp overlap.
template <int KS, int LDK, class E>
__device__ __forceinline__ void masked_qk_block(const uint32_t (&qf)[KS][4], const E* k_s, int Jb, int bI, int lane,
                                                const float* F, const float (&gi)[2], const float (&qi)[2],
                                                float (&x)[2][2][2]) {
  const int g = lane >> 2, t = lane & 3;
  float a[2][4] = {}, a2[2][4] = {};
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    uint32_t b[4];
    mma::ldsm_x4(b, k_s + (16 * Jb + mma::bn_row(lane)) * LDK + 16 * kk + mma::bn_col(lane));
    mma::mma16816<E>((kk & 1) ? a2[0] : a[0], qf[kk], b[0], b[1]);
    mma::mma16816<E>((kk & 1) ? a2[1] : a[1], qf[kk], b[2], b[3]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int j = 16 * Jb + nt * 8 + 2 * t;
    const float2 pj = *reinterpret_cast<const float2*>(F + kFP + j);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = bI + g + 8 * hh;
      x[nt][hh][0] = dev::masked_exp_scale(j <= i, (a[nt][2 * hh] + a2[nt][2 * hh]) * qi[hh], gi[hh] - pj.x);
      x[nt][hh][1] = dev::masked_exp_scale(j + 1 <= i, (a[nt][2 * hh + 1] + a2[nt][2 * hh + 1]) * qi[hh], gi[hh] - pj.y);
    }
  }
}

}  // namespace chunk_fused
}  // namespace cula
