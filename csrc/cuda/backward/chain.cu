// The backwards' shared kernels (chain.h): the tokens' inputs before the main kernels and the
// chain rule after them.
#include "cuda/backward/chain.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "common/error.h"
#include "common/tensor.h"
#include "cuda/backward/block_sum.cuh"
#include "cuda/common/recurrence_math.cuh"

namespace cula {
namespace bwd {
namespace {

using dev::from_bits;
using dev::ld;
using dev::ld_bits;
using dev::st;

constexpr int kRowWarps = 8;  // rows (token, head) per CTA, one warp each
constexpr int kMaxEpl = 8;    // elements of K per lane (K <= 256, a multiple of 32)
constexpr int kSumTokens = 256;  // tokens per partial sum of the parameter gradients

__device__ __forceinline__ int64_t warp_row() { return blockIdx.x * int64_t{kRowWarps} + threadIdx.x / 32; }
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }

// Each token's inputs as the recurrence uses them (SPEC §2), once, in parallel: q^, k^ (scale, L2
// norm), the decay e^a or the log-decay a (gate activation in kernel) and beta (sigmoid). One warp
// per (token, value head), lane l holding elements l, l + 32, ...; q^ and k^ by the first value
// head of each group.
__global__ void __launch_bounds__(32 * kRowWarps) prepare_tokens_kernel(const FwdParams p, const TokenInputs x, int log_decay,
                                                                         int64_t rows) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = threadIdx.x & 31, K = p.K, n = K / 32, G = p.HV / p.H;
  const int64_t f = row / p.HV;
  const int hv = static_cast<int>(row % p.HV), h = hv / G;
  const int64_t b = f / p.T, t = f % p.T;
  const float eA = p.gate_in_kernel && p.A_log ? expf(ld(p.A_log, p.A_log_dt, hv)) : 1.0f;
  // every load of the row first (raw bits, no branch between them), then the arithmetic: loads
  // taken one at a time behind their use left these kernels waiting on memory (ncu: chain_qk at
  // 45% long-scoreboard stalls and 31% of DRAM bandwidth)
  const bool per_channel = p.gate_kind == GateKind::PerChannel;
  const bool biased = p.gate_in_kernel && p.dt_bias;  // (per channel exactly when the gate is)
  const int64_t g_row = b * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2];
  uint32_t gb[kMaxEpl], bb[kMaxEpl];
  if (per_channel) {
#pragma unroll
    for (int m = 0; m < kMaxEpl; ++m)
      if (m < n) {
        const int i = lane + 32 * m;
        gb[m] = ld_bits(p.g, p.g_dt, g_row + i * p.g_s[3]);
        if (biased) bb[m] = ld_bits(p.dt_bias, p.dt_bias_dt, hv * K + i);
      }
  }
  // a scalar or constant gate: one log-decay for the whole row, taken once
  float row_a = 0.0f;
  if (p.gate_kind == GateKind::Constant) {
    row_a = -ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h);
  } else if (!per_channel) {
    row_a = ld(p.g, p.g_dt, g_row);
    if (p.gate_in_kernel) row_a = dev::activate_gate(row_a + (biased ? ld(p.dt_bias, p.dt_bias_dt, hv) : 0.0f), eA, p.has_lb, p.lb);
  }
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m) {
    if (m >= n) break;
    const int i = lane + 32 * m;
    float a = row_a;
    if (per_channel) {
      a = from_bits(gb[m], p.g_dt);
      if (p.gate_in_kernel) a = dev::activate_gate(a + (biased ? from_bits(bb[m], p.dt_bias_dt) : 0.0f), eA, p.has_lb, p.lb);
    }
    x.dec[(f * p.HV + hv) * K + i] = log_decay ? a : expf(a);
  }
  if (lane == 0) {
    float beta = 1.0f;
    if (p.delta) {
      beta = ld(p.beta, p.beta_dt, b * p.beta_s[0] + t * p.beta_s[1] + hv * p.beta_s[2]);
      if (p.beta_sigmoid) beta = dev::beta_sigmoid(beta, p.beta_mult);
    }
    x.beta[f * p.HV + hv] = beta;
  }
  if (hv % G != 0) return;
  float q[kMaxEpl], k[kMaxEpl], sq = 0.0f, sk = 0.0f;
  uint32_t qb[kMaxEpl], kb[kMaxEpl];
  const int64_t q_row = b * p.q_s[0] + t * p.q_s[1] + h * p.q_s[2], k_row = b * p.k_s[0] + t * p.k_s[1] + h * p.k_s[2];
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m)
    if (m < n) {
      const int i = lane + 32 * m;
      qb[m] = ld_bits(p.q, p.q_dt, q_row + i * p.q_s[3]);
      kb[m] = ld_bits(p.k, p.k_dt, k_row + i * p.k_s[3]);
    }
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m) {
    if (m >= n) break;
    q[m] = from_bits(qb[m], p.q_dt), k[m] = from_bits(kb[m], p.k_dt);
    sq += q[m] * q[m], sk += k[m] * k[m];
  }
  float qs = p.scale, ks = 1.0f;
  if (p.l2norm) {
    qs *= rsqrtf(dev::warp_sum(sq) + 1e-6f);
    ks = rsqrtf(dev::warp_sum(sk) + 1e-6f);
  }
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m) {
    if (m >= n) break;
    const int i = lane + 32 * m;
    x.qh[(f * p.H + h) * K + i] = q[m] * qs;
    x.kh[(f * p.H + h) * K + i] = k[m] * ks;
  }
}

struct ChainParams {
  const void *q, *k, *g, *beta, *A_log, *dt_bias;
  int q_dt, k_dt, g_dt, beta_dt, A_log_dt, dt_bias_dt;
  int64_t q_s[4], k_s[4], g_s[4], beta_s[3];
  void *dq, *dk, *dg, *dbeta;
  int dq_dt, dk_dt, dg_dt, dbeta_dt;
  const float* part;
  float* gate_raw;  // [B*T, HV, K or 1]: dg of the raw gate (dt_bias gradient terms)
  float* alog;      // [B*T, HV]: dA_log terms
  float* raw_part;  // [blocks of kSumTokens, HV, K or 1]: the parameter sums per token block
  float* alog_part;  // [blocks, HV]
  int64_t BT;
  int T, H, HV, K, tiles, per_channel, gate_in_kernel, has_lb, delta, beta_sigmoid, l2norm, dt_bias_per_channel;
  float lb, beta_mult, scale;
};

// dq and dk of token f, q/k head h: the partial sums over row tiles and the group's value heads, in
// order, then the L2 norm's and the scale's chain rule. One warp per (token, q/k head).
__global__ void __launch_bounds__(32 * kRowWarps) chain_qk_kernel(const ChainParams c, int64_t rows) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = threadIdx.x & 31, n = c.K / 32, G = c.HV / c.H;
  const int64_t f = row / c.H;
  const int h = static_cast<int>(row % c.H);
  const int64_t b = f / c.T, t = f % c.T;
  const int64_t width = 3 * c.K + 1;
  // both rows' loads first (dq^ and q with dq^'s sums over the other row tiles and value heads, then
  // the same for dk; see prepare_tokens_kernel), then each row's chain rule
  float dy[2][kMaxEpl];
  uint32_t xb[2][kMaxEpl];
  const float* first = c.part + (f * c.HV + h * G) * width + lane;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const void* src = which == 0 ? c.q : c.k;
    const int64_t* s = which == 0 ? c.q_s : c.k_s;
    const int dt = which == 0 ? c.q_dt : c.k_dt;
    const int64_t x_row = b * s[0] + t * s[1] + h * s[2];
    if (!(which == 0 ? c.dq : c.dk)) continue;
#pragma unroll
    for (int m = 0; m < kMaxEpl; ++m)
      if (m < n) dy[which][m] = first[which * c.K + 32 * m], xb[which][m] = ld_bits(src, dt, x_row + (lane + 32 * m) * s[3]);
    if (c.tiles > 1 || G > 1) {  // the sums over the other row tiles and value heads, in order
#pragma unroll
      for (int m = 0; m < kMaxEpl; ++m)
        if (m < n) {
          const int i = lane + 32 * m;
          for (int tl = 0; tl < c.tiles; ++tl)
            for (int g = tl == 0 ? 1 : 0; g < G; ++g)
              dy[which][m] += c.part[((tl * c.BT + f) * c.HV + h * G + g) * width + which * c.K + i];
        }
    }
  }
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    void* dst = which == 0 ? c.dq : c.dk;
    if (!dst) continue;
    const int dt = which == 0 ? c.q_dt : c.k_dt;
    float x[kMaxEpl], ss = 0.0f, xdy = 0.0f;
#pragma unroll
    for (int m = 0; m < kMaxEpl; ++m) {
      if (m >= n) break;
      x[m] = from_bits(xb[which][m], dt);
      ss += x[m] * x[m], xdy += x[m] * dy[which][m];
    }
    float rinv = 1.0f;
    if (c.l2norm) ss = dev::warp_sum(ss), xdy = dev::warp_sum(xdy), rinv = rsqrtf(ss + 1e-6f);
#pragma unroll
    for (int m = 0; m < kMaxEpl; ++m) {
      if (m >= n) break;
      float dx = c.l2norm ? rinv * dy[which][m] - rinv * rinv * rinv * x[m] * xdy : dy[which][m];
      if (which == 0) dx *= c.scale;
      st(dst, which == 0 ? c.dq_dt : c.dk_dt, (f * c.H + h) * static_cast<int64_t>(c.K) + lane + 32 * m, dx);
    }
  }
}

// e^{A_log} of value head hv (1 without A_log), once per row.
__device__ __forceinline__ float gate_scale(const ChainParams& c, int hv) {
  return c.A_log ? expf(ld(c.A_log, c.A_log_dt, hv)) : 1.0f;
}

// dg (and the dA_log / d dt_bias terms) of one element of the gate, from d = dL/da; e = gate_scale.
__device__ __forceinline__ void gate_chain(const ChainParams& c, float d, float x, float e, float& dg, float& alog) {
  if (c.has_lb) {
    const float z = e * x, sg = 1.0f / (1.0f + expf(-z));
    const float dz = d * c.lb * sg * (1.0f - sg);
    dg = dz * e;
    alog = c.A_log ? dz * z : 0.0f;
  } else {
    dg = -d * e / (1.0f + expf(-x));
    alog = -d * e * (x > 20.0f ? x : log1pf(expf(x)));
  }
}

// dbeta and dg of token f, value head hv, and the terms of dA_log / d dt_bias. One warp per
// (token, value head).
__global__ void __launch_bounds__(32 * kRowWarps) chain_gate_kernel(const ChainParams c, int64_t rows) {
  const int64_t row = warp_row();
  if (row >= rows) return;
  const int lane = threadIdx.x & 31, n = c.K / 32;
  const int64_t f = row / c.HV;
  const int hv = static_cast<int>(row % c.HV);
  const int64_t b = f / c.T, t = f % c.T;
  const int64_t width = 3 * c.K + 1;
  const bool gate = c.dg || c.gate_in_kernel, with_dbeta = c.delta && lane == 0 && c.dbeta;
  float da[kMaxEpl], dsum = 0.0f;
  uint32_t gb[kMaxEpl], bb[kMaxEpl];
  const int64_t g_row = b * c.g_s[0] + t * c.g_s[1] + hv * c.g_s[2];
  const float* first = c.part + (f * c.HV + hv) * width + 2 * c.K + lane;
  // the row's loads first, beta's among them (see prepare_tokens_kernel)
  if (gate) {
#pragma unroll
    for (int m = 0; m < kMaxEpl; ++m)
      if (m < n) {
        da[m] = first[32 * m];
        if (c.gate_in_kernel && c.per_channel) {
          gb[m] = ld_bits(c.g, c.g_dt, g_row + (lane + 32 * m) * c.g_s[3]);
          if (c.dt_bias) bb[m] = ld_bits(c.dt_bias, c.dt_bias_dt, c.dt_bias_per_channel ? hv * c.K + lane + 32 * m : hv);
        }
      }
  }
  float db = with_dbeta ? c.part[(f * c.HV + hv) * width + 3 * c.K] : 0.0f;
  const uint32_t beta_bits =
      with_dbeta && c.beta_sigmoid ? ld_bits(c.beta, c.beta_dt, b * c.beta_s[0] + t * c.beta_s[1] + hv * c.beta_s[2]) : 0u;
  if (with_dbeta) {
    for (int tl = 1; tl < c.tiles; ++tl) db += c.part[((tl * c.BT + f) * c.HV + hv) * width + 3 * c.K];
    if (c.beta_sigmoid) {
      const float x = from_bits(beta_bits, c.beta_dt);
      const float sg = 1.0f / (1.0f + __expf(-x));
      db *= c.beta_mult * sg * (1.0f - sg);
    }
    st(c.dbeta, c.dbeta_dt, f * c.HV + hv, db);
  }
  if (!gate) return;
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m) {
    if (m >= n) break;
    for (int tl = 1; tl < c.tiles; ++tl) da[m] += c.part[((tl * c.BT + f) * c.HV + hv) * width + 2 * c.K + lane + 32 * m];
    dsum += da[m];
  }
  const int n_raw = c.per_channel ? c.K : 1;
  if (!c.per_channel) {  // a scalar gate: its gradient is the sum over the channels
    const float d = dev::warp_sum(dsum);
    if (lane != 0) return;
    float dg = d, alog = 0.0f;
    if (c.gate_in_kernel) {
      float x = ld(c.g, c.g_dt, b * c.g_s[0] + t * c.g_s[1] + hv * c.g_s[2]);
      if (c.dt_bias) x += ld(c.dt_bias, c.dt_bias_dt, hv);
      gate_chain(c, d, x, gate_scale(c, hv), dg, alog);
      c.gate_raw[f * c.HV + hv] = dg;
      c.alog[f * c.HV + hv] = alog;
    }
    if (c.dg) st(c.dg, c.dg_dt, f * c.HV + hv, dg);
    return;
  }
  float alog_sum = 0.0f;
  const float e = c.gate_in_kernel ? gate_scale(c, hv) : 1.0f;
#pragma unroll
  for (int m = 0; m < kMaxEpl; ++m) {
    if (m >= n) break;
    const int i = lane + 32 * m;
    float dg = da[m], alog = 0.0f;
    if (c.gate_in_kernel) {
      float x = from_bits(gb[m], c.g_dt);
      if (c.dt_bias) x += from_bits(bb[m], c.dt_bias_dt);
      gate_chain(c, da[m], x, e, dg, alog);
      c.gate_raw[(f * c.HV + hv) * n_raw + i] = dg;
      alog_sum += alog;
    }
    if (c.dg) st(c.dg, c.dg_dt, (f * c.HV + hv) * static_cast<int64_t>(c.K) + i, dg);
  }
  if (c.gate_in_kernel) {
    alog_sum = dev::warp_sum(alog_sum);
    if (lane == 0) c.alog[f * c.HV + hv] = alog_sum;
  }
}

// dA_log[hv] and d dt_bias[hv, .], in two ordered passes: each CTA adds the terms of kSumTokens
// tokens for one value head (token lanes in order, then the lanes in order), then
// param_sum_kernel adds the blocks in order. Deterministic, and parallel over the tokens.
__global__ void __launch_bounds__(256) param_partial_kernel(const ChainParams c, int want_ddt, int want_alog) {
  __shared__ float lanes[256];
  const int hv = blockIdx.x % c.HV, blk = blockIdx.x / c.HV, tid = threadIdx.x;
  const int n_raw = c.per_channel ? c.K : 1, L = 256 / n_raw;  // token lanes per channel
  const int64_t f0 = static_cast<int64_t>(blk) * kSumTokens, f1 = min(c.BT, f0 + kSumTokens);
  if (want_ddt) {
    const int ch = tid % n_raw, l = tid / n_raw;
    float s = 0.0f;
    if (l < L)
      for (int64_t f = f0 + l; f < f1; f += L) s += c.gate_raw[(f * c.HV + hv) * n_raw + ch];
    lanes[tid] = s;
    __syncthreads();
    if (tid < n_raw) {
      float acc = 0.0f;
      for (int j = 0; j < L; ++j) acc += lanes[j * n_raw + tid];
      c.raw_part[(static_cast<int64_t>(blk) * c.HV + hv) * n_raw + tid] = acc;
    }
  }
  if (want_alog) {
    const int64_t f = f0 + tid;
    __shared__ float shm[32];
    const float s = block_sum(f < f1 ? c.alog[f * c.HV + hv] : 0.0f, shm);
    if (tid == 0) c.alog_part[static_cast<int64_t>(blk) * c.HV + hv] = s;
  }
}

__global__ void __launch_bounds__(256) param_sum_kernel(const ChainParams c, int blocks, void* dA_log, int dA_log_dt, void* ddt,
                                                        int ddt_dt) {
  __shared__ float shm[32];
  const int hv = blockIdx.x;
  const int n_raw = c.per_channel ? c.K : 1;
  if (ddt) {
    for (int i = threadIdx.x; i < n_raw; i += blockDim.x) {
      float s = 0.0f;
      for (int blk = 0; blk < blocks; ++blk) s += c.raw_part[(static_cast<int64_t>(blk) * c.HV + hv) * n_raw + i];
      st(ddt, ddt_dt, static_cast<int64_t>(hv) * n_raw + i, s);
    }
  }
  if (dA_log) {
    float s = 0.0f;
    for (int blk = threadIdx.x; blk < blocks; blk += blockDim.x) s += c.alog_part[static_cast<int64_t>(blk) * c.HV + hv];
    s = block_sum(s, shm);
    if (threadIdx.x == 0) st(dA_log, dA_log_dt, hv, s);
  }
}

// Zeros of a parameter gradient the gate does not reach (gate not in kernel).
__global__ void zero_kernel(void* p, int dt, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    st(p, dt, i, 0.0f);
}

}  // namespace

int64_t token_inputs_bytes(const Recurrence& r) {
  const int64_t BT = r.B * r.T;
  return 2 * align256(BT * r.H * r.K * 4) + align256(BT * r.HV * r.K * 4) + align256(BT * r.HV * 4);
}

TokenInputs token_inputs_at(void* base, const Recurrence& r) {
  const int64_t BT = r.B * r.T, qk = align256(BT * r.H * r.K * 4), dec = align256(BT * r.HV * r.K * 4);
  char* w = static_cast<char*>(base);
  return TokenInputs{reinterpret_cast<float*>(w), reinterpret_cast<float*>(w + qk), reinterpret_cast<float*>(w + 2 * qk),
                     reinterpret_cast<float*>(w + 2 * qk + dec)};
}

void launch_token_inputs(const FwdParams& p, const TokenInputs& x, bool log_decay, cudaStream_t stream) {
  const int64_t BT = static_cast<int64_t>(p.N == 0 ? 0 : (p.cu ? 1 : p.N)) * p.T;
  if (BT * std::max(p.H, p.HV) >= (int64_t{1} << 31)) throw_unsupported("chunk_bwd", "too many tokens x heads for one launch");
  if (BT > 0) prepare_tokens_kernel<<<row_blocks(BT * p.HV), 32 * kRowWarps, 0, stream>>>(p, x, log_decay, BT * p.HV);
}

int64_t chain_bytes(const Recurrence& r) {
  const int64_t BT = r.B * r.T, n_raw = r.tr.gate == GateKind::PerChannel ? r.K : 1;
  const int64_t blocks = (BT + kSumTokens - 1) / kSumTokens;
  return r.gate_in_kernel ? align256(BT * r.HV * n_raw * 4) + align256(BT * r.HV * 4) + align256(blocks * r.HV * n_raw * 4) +
                                align256(blocks * r.HV * 4)
                          : 0;
}

void launch_chain(const Recurrence& r, const cula_chunk_bwd_args& a, const FwdParams& p, const float* part, int tiles,
                  void* chain_ws, cudaStream_t stream) {
  const int64_t BT = r.B * r.T, K = r.K;
  const int per_channel = r.tr.gate == GateKind::PerChannel;
  const int64_t n_raw = per_channel ? K : 1;
  float* gate_raw = r.gate_in_kernel ? static_cast<float*>(chain_ws) : nullptr;
  float* alog = r.gate_in_kernel ? gate_raw + align256(BT * r.HV * n_raw * 4) / 4 : nullptr;
  const int64_t blocks = (BT + kSumTokens - 1) / kSumTokens;
  float* raw_part = r.gate_in_kernel ? alog + align256(BT * r.HV * 4) / 4 : nullptr;
  float* alog_part = r.gate_in_kernel ? raw_part + align256(blocks * r.HV * n_raw * 4) / 4 : nullptr;
  ChainParams c{};
  c.q = p.q, c.k = p.k, c.g = p.g, c.beta = p.beta, c.A_log = p.A_log, c.dt_bias = p.dt_bias;
  c.q_dt = p.q_dt, c.k_dt = p.k_dt, c.g_dt = p.g_dt, c.beta_dt = p.beta_dt, c.A_log_dt = p.A_log_dt,
  c.dt_bias_dt = p.dt_bias_dt;
  std::copy(p.q_s, p.q_s + 4, c.q_s), std::copy(p.k_s, p.k_s + 4, c.k_s), std::copy(p.g_s, p.g_s + 4, c.g_s);
  std::copy(p.beta_s, p.beta_s + 3, c.beta_s);
  if (a.dq) c.dq = a.dq->data, c.dq_dt = a.dq->dtype;
  if (a.dk) c.dk = a.dk->data, c.dk_dt = a.dk->dtype;
  if (a.dg) c.dg = a.dg->data, c.dg_dt = a.dg->dtype;
  if (a.dbeta) c.dbeta = a.dbeta->data, c.dbeta_dt = a.dbeta->dtype;
  c.part = part, c.gate_raw = gate_raw, c.alog = alog, c.raw_part = raw_part, c.alog_part = alog_part;
  c.BT = BT, c.T = static_cast<int>(r.T), c.H = static_cast<int>(r.H), c.HV = static_cast<int>(r.HV);
  c.K = static_cast<int>(K), c.tiles = tiles, c.per_channel = per_channel, c.gate_in_kernel = r.gate_in_kernel;
  c.has_lb = r.has_lb, c.delta = r.tr.delta, c.beta_sigmoid = r.beta_sigmoid, c.l2norm = r.l2norm;
  c.dt_bias_per_channel = r.dt_bias_per_channel;
  c.lb = static_cast<float>(r.lb), c.beta_mult = r.neg_eig ? 2.0f : 1.0f, c.scale = static_cast<float>(r.scale);
  if (BT > 0 && (a.dq || a.dk)) chain_qk_kernel<<<row_blocks(BT * r.H), 32 * kRowWarps, 0, stream>>>(c, BT * r.H);
  if (BT > 0 && (a.dbeta || a.dg || r.gate_in_kernel))
    chain_gate_kernel<<<row_blocks(BT * r.HV), 32 * kRowWarps, 0, stream>>>(c, BT * r.HV);
  if (a.dA_log || a.ddt_bias) {
    if (r.gate_in_kernel) {
      if (blocks > 0)
        param_partial_kernel<<<static_cast<unsigned>(blocks * r.HV), 256, 0, stream>>>(c, a.ddt_bias != nullptr, a.dA_log != nullptr);
      param_sum_kernel<<<static_cast<unsigned>(r.HV), 256, 0, stream>>>(c, static_cast<int>(blocks), a.dA_log ? a.dA_log->data : nullptr,
                                                                         a.dA_log ? a.dA_log->dtype : 0,
                                                                         a.ddt_bias ? a.ddt_bias->data : nullptr,
                                                                         a.ddt_bias ? a.ddt_bias->dtype : 0);
    } else {
      for (cula_tensor* t : {a.dA_log, a.ddt_bias})
        if (t) zero_kernel<<<8, 256, 0, stream>>>(t->data, t->dtype, numel(*t));
    }
  }
}

}  // namespace bwd
}  // namespace cula
