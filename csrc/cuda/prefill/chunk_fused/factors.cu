// The fused chunk engine's factor kernel (factors.cuh).
#include "cuda/prefill/chunk_fused/factors.cuh"

namespace cula {
namespace chunk_fused {
namespace {

// Squared norms of the chunk's q and k rows from t0 (l2norm), row r's in slot r / 32 of lane r % 32.
// A row's K / 8 16-byte pieces go to K / 8 lanes, so a load instruction reads whole rows (was: a
// lane per row walking its 256 bytes, each load a scattered, dependent one: 0.92 ms at 65536 tokens
// and 16 heads, against 0.18 ms of traffic), and the sums meet by shuffles.
__device__ __forceinline__ void row_norms2(const FwdParams& p, const Seq& sq, int64_t t0, int Lc, int h, int lane,
                                           float (&q2)[2], float (&k2)[2]) {
  const int pieces = p.K / 8, rows = 32 / pieces;  // lanes per row, rows per step
  const int sub = lane / pieces, piece = lane % pieces;
  const bool half_in = p.q_dt == CULA_FLOAT16;  // else bf16 (16-bit element pairs either way)
  const bf16* qb = static_cast<const bf16*>(p.q) + sq.b_row * p.q_s[0] + h * p.q_s[2] + 8 * piece;
  const bf16* kb = static_cast<const bf16*>(p.k) + sq.b_row * p.k_s[0] + h * p.k_s[2] + 8 * piece;
  q2[0] = q2[1] = k2[0] = k2[1] = 0.0f;
#pragma unroll 4
  for (int r0 = 0; r0 < kBT; r0 += rows) {
    const int r = r0 + sub;
    float sq_q = 0.0f, sq_k = 0.0f;
    if (r < Lc) {
      const int64_t tok = t0 + r;
      const uint4 qv = *reinterpret_cast<const uint4*>(qb + tok * p.q_s[1]);
      const uint4 kv = *reinterpret_cast<const uint4*>(kb + tok * p.k_s[1]);
      const uint32_t *qw = reinterpret_cast<const uint32_t*>(&qv), *kw = reinterpret_cast<const uint32_t*>(&kv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 u = half_in ? mma::unpack<__half>(qw[j]) : unpack(qw[j]);
        const float2 w = half_in ? mma::unpack<__half>(kw[j]) : unpack(kw[j]);
        sq_q += u.x * u.x + u.y * u.y;
        sq_k += w.x * w.x + w.y * w.y;
      }
    }
    for (int d = pieces / 2; d >= 1; d >>= 1) {
      sq_q += __shfl_xor_sync(0xffffffffu, sq_q, d);
      sq_k += __shfl_xor_sync(0xffffffffu, sq_k, d);
    }
    for (int s = 0; s < rows; ++s) {  // row r0 + s's sums, from its lane group, to lane (r0 + s) % 32
      const float vq = __shfl_sync(0xffffffffu, sq_q, s * pieces), vk = __shfl_sync(0xffffffffu, sq_k, s * pieces);
      const int rr = r0 + s;
      if (lane == (rr & 31)) {
        if (rr < 32) q2[0] = vq, k2[0] = vk;
        else q2[1] = vq, k2[1] = vk;
      }
    }
  }
}

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
  float q2[2] = {}, k2[2] = {};
  if (p.l2norm) row_norms2(p, sq, t0, Lc, h, lane, q2, k2);
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
        qs *= rsqrtf(q2[hh] + 1e-6f);
        ks = rsqrtf(k2[hh] + 1e-6f);
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
