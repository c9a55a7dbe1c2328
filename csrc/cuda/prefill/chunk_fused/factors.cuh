// Row factors of the fused chunk engine: the factor kernel (factors.cu) and the constant-decay
// factors that the fused kernels write themselves.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/prefill/chunk_fused/config.cuh"

namespace cula {
namespace chunk_fused {

// The per-token log-decay of a constant-decay (Lightning) value head hv of query head h: -decay,
// one rate per query head or per value head.
__device__ __forceinline__ float constant_log_decay(const FwdParams& p, int hv, int h) {
  return -dev::ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h);
}

// A constant decay without l2norm (Lightning): every row factor of a chunk follows from the
// per-token log-decay a and the chunk length Lc (G_r = a (min(r, Lc - 1) + 1), qs = scale, ks = 1),
// so the fused kernels write them themselves (no factor kernel). Four consecutive floats of the
// factor block, from float e4 * 4 on.
__device__ __forceinline__ float4 constant_decay_factors(int e4, float a, float scale, int Lc) {
  // a float4 lies in one region of the block (regions of kBT floats, kFL = 80 float4 in)
  const int region = e4 / (kBT / 4), row0 = (e4 % (kBT / 4)) * 4;
  const float glast = a * static_cast<float>(Lc);
  float r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float G = a * static_cast<float>(min(row0 + j, Lc - 1) + 1);
    // kFO = scale e^G, kFV = e^{G_last - G}, kFL = e^{G_last}: one exponential per float
    const float e = __expf(region == 2 ? G : region == 3 ? glast - G : glast);
    r[j] = region == 0 || region == 4 ? G : region == 1 ? scale : region == 2 ? scale * e : e;  // kFP: ln ks = 0
  }
  return make_float4(r[0], r[1], r[2], r[3]);
}

// The factor kernel over every (chunk, value head) pair on the stream: G, qs, qs e^G,
// ks e^{G_last - G}, G - ln ks per row and e^{G_last}, kFactorFloats per pair.
void launch_chunk_factors(const FwdParams& p, const int32_t* chunk_base, float* fac, int64_t pairs,
                          cudaStream_t stream);

}  // namespace chunk_fused
}  // namespace cula
