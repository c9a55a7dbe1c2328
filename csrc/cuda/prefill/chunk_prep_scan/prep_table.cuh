// Stage of the prep kernel: the per-channel exponent table (after the gate pass, before B_c).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/kerutils/device_utils.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_common.cuh"

namespace cula {
namespace chunk_prep_scan {

// Per-channel exponent table; without the delta rule (and for KDA's steep channels) the
// right operands (Kt) are taken through the last row of their block, so the pair and Kd
// factors are too (all <= 1)
// (8 warps: the pair rows by the first K threads, the others by the next K)
// bfirst_s, bsum_s: [4][K] each block's first gate and gate sum per channel; tab: the rows of
// prep_common.cuh (kTab*), K floats each.
template <int K, class F, bool kAnyDecay, int KH, int NT>
__device__ __forceinline__ void exponent_table(int tid, const float* bfirst_s, const float* bsum_s, float* tab) {
  for_strided<KH * K, NT>(tid, [&](int i) {
    const int c = i % K;
    float gb[4], ge[4], gl = 0.0f;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      gb[b] = gl + bfirst_s[b * K + c];
      gl += bsum_s[b * K + c];
      // the row the right operands of block b are taken through: its last (GLA; KDA's steep
      // channels) or its first (KDA's Kr)
      ge[b] = !F::kDelta || (kAnyDecay && kda_steep(bfirst_s[b * K + c], bsum_s[b * K + c])) ? gl : gb[b];
    }
    if (KH == 1 || i < K)
#pragma unroll
      for (int b = 1; b < 4; ++b)
#pragma unroll
        for (int a = 0; a < b; ++a) tab[tab_pair(b, a) * K + c] = dev::exp_ftz(gb[b] - ge[a]);
    if (KH == 1 || i >= K) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        tab[(kTabEb + b) * K + c] = dev::exp_ftz(gb[b]);
        tab[(kTabEd + b) * K + c] = dev::exp_ftz(gl - ge[b]);
      }
      tab[kTabLast * K + c] = dev::exp_ftz(gl);
    }
  });
}

}  // namespace chunk_prep_scan
}  // namespace cula
