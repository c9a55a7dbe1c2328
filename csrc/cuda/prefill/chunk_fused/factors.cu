// The fused chunk engine's factor kernel (factors.cuh).
#include "cuda/prefill/chunk_fused/factors.cuh"

namespace cula {
namespace chunk_fused {
namespace {

// Row factors of every (chunk, value head): one warp each, lane holds rows lane and lane + 32.
__global__ void __launch_bounds__(32 * kFactorWarps)
    chunk_factor_kernel(const FwdParams p, const int32_t* __restrict__ chunk_base, float* __restrict__ fac, int pairs) {
  const int lane = threadIdx.x & 31;
  const int pair = static_cast<int>(blockIdx.x) * kFactorWarps + static_cast<int>(threadIdx.x >> 5);
  if (pair >= pairs) return;
  const int hv = pair % p.HV, cidx = pair / p.HV;
  int n, ci;
  if (!chunk::locate(p, chunk_base, cidx, n, ci)) return;
  const Seq sq = seq_of(p, n);
  const int64_t t0 = sq.bos + static_cast<int64_t>(ci) * kBT;
  const int Lc = static_cast<int>(min(int64_t{kBT}, sq.eos - t0));
  const int h = hv / (p.HV / p.H);
  const float eA = (p.gate_in_kernel && p.A_log) ? __expf(dev::ld(p.A_log, p.A_log_dt, hv)) : 1.0f;
  const float bias = (p.gate_in_kernel && p.dt_bias) ? dev::ld(p.dt_bias, p.dt_bias_dt, hv) : 0.0f;
  const float decay = p.gate_kind == GateKind::Constant ? constant_log_decay(p, hv, h) : 0.0f;
  float* f = fac + static_cast<int64_t>(pair) * kFactorFloats;
  float x[2], qsr[2], ksr[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = lane + 32 * hh;
    float a = 0.0f, qs = p.scale, ks = 1.0f;
    if (row < Lc) {
      const int64_t tok = t0 + row;
      if (p.gate_kind == GateKind::Constant) {
        a = decay;
      } else {
        a = dev::ld(p.g, p.g_dt, sq.b_row * p.g_s[0] + tok * p.g_s[1] + hv * p.g_s[2]);
        if (p.gate_in_kernel) a = dev::activate_gate(a + bias, eA, p.has_lb, p.lb);
      }
      a = dev::chunk_log_decay(a);
      if (p.l2norm) {
        const bf16* qr = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + tok * p.q_s[1] + h * p.q_s[2];
        const bf16* kr = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + tok * p.k_s[1] + h * p.k_s[2];
        const bool half_in = p.q_dt == CULA_FLOAT16;  // else bf16 (16-bit element pairs either way)
        float q2 = 0.0f, k2 = 0.0f;
        for (int c8 = 0; c8 < p.K; c8 += 8) {
          const uint4 qv = *reinterpret_cast<const uint4*>(qr + c8), kv = *reinterpret_cast<const uint4*>(kr + c8);
          const uint32_t *qw = reinterpret_cast<const uint32_t*>(&qv), *kw = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 u = half_in ? mma::unpack<__half>(qw[j]) : unpack(qw[j]);
            const float2 w = half_in ? mma::unpack<__half>(kw[j]) : unpack(kw[j]);
            q2 += u.x * u.x + u.y * u.y;
            k2 += w.x * w.x + w.y * w.y;
          }
        }
        qs *= rsqrtf(q2 + 1e-6f);
        ks = rsqrtf(k2 + 1e-6f);
      }
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float u = __shfl_up_sync(0xffffffffu, a, d);
      if (lane >= d) a += u;
    }
    x[hh] = a;
    qsr[hh] = qs, ksr[hh] = ks;
  }
  x[1] += __shfl_sync(0xffffffffu, x[0], 31);
  const float glast = __shfl_sync(0xffffffffu, x[1], 31);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = lane + 32 * hh;
    f[kFG + row] = x[hh];
    f[kFQS + row] = qsr[hh];
    f[kFO + row] = qsr[hh] * __expf(x[hh]);
    f[kFV + row] = ksr[hh] * __expf(glast - x[hh]);
    f[kFP + row] = x[hh] - __logf(ksr[hh]);
  }
  if (lane < 4) f[kFL + lane] = __expf(glast);
}

}  // namespace

void launch_chunk_factors(const FwdParams& p, const int32_t* chunk_base, float* fac, int64_t pairs,
                          cudaStream_t stream) {
  chunk_factor_kernel<<<static_cast<unsigned>((pairs + kFactorWarps - 1) / kFactorWarps), 32 * kFactorWarps, 0,
                        stream>>>(p, chunk_base, fac, static_cast<int>(pairs));
}

}  // namespace chunk_fused
}  // namespace cula
