// Backward of every family on CUDA tensors, token by token (the reverse-time recurrence of SPEC §2,
// the same steps as the float64 reference backward).
//
// The GPU backward for every configuration: varlen (offsets on the device or the host), GVA, every
// gate form in kernel with its A_log / dt_bias gradients, q/k L2 norm, beta sigmoid and negative
// eigenvalues, initial-state and final-state gradients in either layout, any float input dtype and
// any head size the CUDA forward takes (K in {64, 128, 256}, any V). It is sequential in T (a
// chunked tensor-core backward is the fast path to come), and deterministic: every sum runs in a
// fixed order, no floating-point atomics.
//
// Four kernels:
//  0. prepare_tokens_kernel, per (token, value head): q^, k^ (scale, L2 norm), e^a (gate activation)
//     and beta (sigmoid) once, in parallel, so that the sequential loops below only load them.
//  1. recurrent_bwd_kernel, one CTA per (sequence n, value head hv, tile of 32 state rows along V);
//     8 warps x 4 rows, lane l holds elements [l*EPL, (l+1)*EPL) of each row (EPL = K/32), as the
//     forward kernel does. Every loop loads token t+1 (t-1 going back) while computing t.
//     a. Forward over the sequence from the initial state, saving the state at the start of every
//        kSeg-token segment (workspace `ckpt`).
//     b. Segments last to first: the segment's states S_{t-1} are recomputed from its checkpoint
//        into `scratch` (each thread reads back only what it wrote: no barrier), then its tokens
//        last to first run the reference's backward step on the state gradient D held in
//        registers. Per token the rows' contributions to dq^, dk^ and the log-decay gradient (sums
//        over V) are added over the CTA's warps in shared memory (double-buffered: one barrier per
//        token) and written per row tile to `part`; dv is complete per row and written directly.
//     c. D at the sequence start is the initial-state gradient.
//  2. chain_qk_kernel, per (token, q/k head): the row tiles and the value heads of the group summed
//     in order, then the L2 norm's and the scale's chain rule (dq, dk).
//  3. chain_gate_kernel, per (token, value head): dbeta through the sigmoid, dg through the gate
//     activation; the A_log / dt_bias contributions go to a workspace that param_sum_kernel adds
//     over the tokens in order.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "cuda/backward/recurrent_bwd.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/check.h"

namespace cula {
namespace {

using dev::ld;
using dev::st;

constexpr int kWarps = 8;
constexpr int kRows = 4;                   // state rows per warp
constexpr int kTileRows = kWarps * kRows;  // rows per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kSeg = 16;  // tokens per checkpoint segment

struct BwdParams {
  FwdParams f;  // the forward's inputs and options (out, final state, pool unused)
  const void* dO;
  int dO_dt;
  int64_t dO_s[4];
  const void* dht;
  int dht_dt;
  void* dh0;
  int dh0_dt;
  void* dv;
  int dv_dt;
  int64_t dv_s[4];
  int64_t BT;        // tokens (B*T)
  int tiles;         // row tiles along V
  float* ckpt;       // [segments, HV, tiles, kThreads, kRows, EPL]
  float* scratch;    // [CTAs, kSeg, kThreads, kRows, EPL]
  float* part;       // [tiles, B*T, HV, 3K + 1]: dq^, dk^, da partial sums and dbeta
  // the tokens' preprocessed inputs (prepare_tokens_kernel)
  float* qh;    // [B*T, H, K]: scale * (l2norm?)(q)
  float* kh;    // [B*T, H, K]: (l2norm?)(k)
  float* dec;   // [B*T, HV, K]: e^a
  float* beta;  // [B*T, HV]: beta after the sigmoid, 1 without the delta rule
};

// One token's inputs for a warp's rows: q^, k^, the decay e^a per element and beta (1 without the
// delta rule) as prepare_tokens_kernel left them, v and dO of the warp's rows (0 past V).
template <int EPL>
struct Token {
  float q[EPL], k[EPL], dec[EPL], beta, v[kRows], dO[kRows];
};

// Reads tokens for one warp. The loops load token t+1 (or t-1) while computing t: the loads are the
// longest latency of the sequential loop.
template <int EPL>
struct TokenReader {
  const BwdParams& bp;
  int b_row, h, hv, k0, j0;

  __device__ void vec(const float* src, float (&dst)[EPL]) const {
    if constexpr (EPL % 4 == 0) {
#pragma unroll
      for (int i = 0; i < EPL / 4; ++i) {
        const float4 x = reinterpret_cast<const float4*>(src)[i];
        dst[4 * i] = x.x, dst[4 * i + 1] = x.y, dst[4 * i + 2] = x.z, dst[4 * i + 3] = x.w;
      }
    } else {
      const float2 x = *reinterpret_cast<const float2*>(src);
      dst[0] = x.x, dst[1] = x.y;
    }
  }

  __device__ void read(Token<EPL>& x, int64_t t, bool with_dO) const {
    const FwdParams& p = bp.f;
    constexpr int K = EPL * 32;
    const int64_t f = static_cast<int64_t>(b_row) * p.T + t;
    vec(bp.qh + (f * p.H + h) * K + k0, x.q);
    vec(bp.kh + (f * p.H + h) * K + k0, x.k);
    vec(bp.dec + (f * p.HV + hv) * K + k0, x.dec);
    x.beta = bp.beta[f * p.HV + hv];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool ok = j0 + r < p.V;
      x.v[r] = ok ? ld(p.v, p.v_dt, b_row * p.v_s[0] + t * p.v_s[1] + hv * p.v_s[2] + (j0 + r) * p.v_s[3]) : 0.0f;
      x.dO[r] = ok && with_dO ? ld(bp.dO, bp.dO_dt, b_row * bp.dO_s[0] + t * bp.dO_s[1] + hv * bp.dO_s[2] + (j0 + r) * bp.dO_s[3])
                              : 0.0f;
    }
  }
};

// Sum of x over the block's threads, the same order every call (thread count a multiple of 32).
__device__ float block_sum(float x, float* shm) {
  x = dev::warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();  // shm free from an earlier call
  if (lane == 0) shm[warp] = x;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < nw; ++w) s += shm[w];
  return s;
}

// Each token's inputs as the recurrence uses them (SPEC §2), once, in parallel: q^, k^ (scale, L2
// norm), the decay e^a (gate activation in kernel) and beta (sigmoid). One CTA per (token, value
// head), one thread per element of K; q^ and k^ by the first value head of each group.
__global__ void prepare_tokens_kernel(const BwdParams bp) {
  __shared__ float shm[32];
  const FwdParams& p = bp.f;
  const int64_t f = blockIdx.x / p.HV;
  const int hv = static_cast<int>(blockIdx.x % p.HV), i = threadIdx.x, K = p.K, G = p.HV / p.H, h = hv / G;
  const int64_t b = f / p.T, t = f % p.T;
  float a;
  if (p.gate_kind == GateKind::Constant) {
    a = -ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : h);
  } else {
    a = p.gate_kind == GateKind::PerChannel ? ld(p.g, p.g_dt, b * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2] + i * p.g_s[3])
                                            : ld(p.g, p.g_dt, b * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2]);
    if (p.gate_in_kernel) {
      const float eA = p.A_log ? expf(ld(p.A_log, p.A_log_dt, hv)) : 1.0f;
      const float bias = p.dt_bias ? ld(p.dt_bias, p.dt_bias_dt, p.dt_bias_per_channel ? hv * K + i : hv) : 0.0f;
      a = dev::activate_gate(a + bias, eA, p.has_lb, p.lb);
    }
  }
  bp.dec[(f * p.HV + hv) * K + i] = expf(a);
  if (i == 0) {
    float beta = 1.0f;
    if (p.delta) {
      beta = ld(p.beta, p.beta_dt, b * p.beta_s[0] + t * p.beta_s[1] + hv * p.beta_s[2]);
      if (p.beta_sigmoid) beta = dev::beta_sigmoid_precise(beta, p.beta_mult);
    }
    bp.beta[f * p.HV + hv] = beta;
  }
  if (hv % G != 0) return;
  float q = ld(p.q, p.q_dt, b * p.q_s[0] + t * p.q_s[1] + h * p.q_s[2] + i * p.q_s[3]);
  float k = ld(p.k, p.k_dt, b * p.k_s[0] + t * p.k_s[1] + h * p.k_s[2] + i * p.k_s[3]);
  float qs = p.scale, ks = 1.0f;
  if (p.l2norm) {
    qs *= rsqrtf(block_sum(q * q, shm) + 1e-6f);
    ks = rsqrtf(block_sum(k * k, shm) + 1e-6f);
  }
  bp.qh[(f * p.H + h) * K + i] = q * qs;
  bp.kh[(f * p.H + h) * K + i] = k * ks;
}

// The sums over the warp's rows of sum_e x[r][e] y[e], returned for every row on every lane.
template <int EPL>
__device__ __forceinline__ void row_dots(const float (&x)[kRows][EPL], const float (&y)[EPL], float (&out)[kRows],
                                         int lane) {
  float d[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    d[r] = 0;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d[r] += x[r][e] * y[e];
  }
  const float mine = dev::warp_sum_scatter<kRows>(d, lane);
#pragma unroll
  for (int r = 0; r < kRows; ++r) out[r] = __shfl_sync(0xffffffffu, mine, dev::scatter_lane<kRows>(r));
}

// The value each row writes, from the decayed state S' of the rows: u = v - S'^T k with the delta
// rule, else v.
template <int EPL>
__device__ __forceinline__ void written_values(const float (&sp)[kRows][EPL], const Token<EPL>& x, bool delta,
                                               float (&u)[kRows], int lane) {
  if (delta) {
    row_dots<EPL>(sp, x.k, u, lane);
#pragma unroll
    for (int r = 0; r < kRows; ++r) u[r] = x.v[r] - u[r];
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r) u[r] = x.v[r];
  }
}

// The forward step on the rows: S' = S * decay; u = written_values; S = S' + beta k u^T.
template <int EPL>
__device__ __forceinline__ void forward_step(float (&s)[kRows][EPL], const Token<EPL>& x, bool delta, int lane) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e) s[r][e] *= x.dec[e];
  float u[kRows];
  written_values<EPL>(s, x, delta, u, lane);
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e) s[r][e] += x.beta * x.k[e] * u[r];
}

// A thread's kRows x EPL state elements as float4s at `dst` (kRows * EPL is a multiple of 4).
template <int EPL>
__device__ __forceinline__ void save(float* dst, const float (&s)[kRows][EPL]) {
  float4* d = reinterpret_cast<float4*>(dst);
#pragma unroll
  for (int i = 0; i < kRows * EPL / 4; ++i) {
    const int a = 4 * i;
    d[i] = make_float4(s[a / EPL][a % EPL], s[(a + 1) / EPL][(a + 1) % EPL], s[(a + 2) / EPL][(a + 2) % EPL],
                       s[(a + 3) / EPL][(a + 3) % EPL]);
  }
}
template <int EPL>
__device__ __forceinline__ void restore(const float* src, float (&s)[kRows][EPL]) {
  const float4* d = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int i = 0; i < kRows * EPL / 4; ++i) {
    const float4 x = d[i];
    const int a = 4 * i;
    s[a / EPL][a % EPL] = x.x, s[(a + 1) / EPL][(a + 1) % EPL] = x.y;
    s[(a + 2) / EPL][(a + 2) % EPL] = x.z, s[(a + 3) / EPL][(a + 3) % EPL] = x.w;
  }
}

template <int EPL>
__global__ void __launch_bounds__(kThreads, 1) recurrent_bwd_kernel(const BwdParams bp) {
  constexpr int K = EPL * 32;
  constexpr int kPerThread = kRows * EPL;
  const FwdParams& p = bp.f;
  extern __shared__ float red_smem[];  // [2][kWarps][3K + 1]: dynamic, over 48 KB for K = 256
  auto red = reinterpret_cast<float(*)[kWarps][3 * K + 1]>(red_smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tile = static_cast<int>(blockIdx.x % bp.tiles);
  const int hv = static_cast<int>((blockIdx.x / bp.tiles) % p.HV);
  const int n = static_cast<int>(blockIdx.x / (static_cast<unsigned>(bp.tiles) * p.HV));
  const int h = hv / (p.HV / p.H);
  const int j0 = tile * kTileRows + warp * kRows;
  const int k0 = lane * EPL;
  const Seq sq = seq_of(p, n);
  const int64_t bos = sq.bos, len = sq.eos - sq.bos;
  const int b_row = sq.b_row;
  int64_t seg_base = 0;  // first checkpoint segment of this sequence
  if (p.cu) {
    for (int m = 0; m < n; ++m) seg_base += (cu_at(p, m + 1) - cu_at(p, m) + kSeg - 1) / kSeg;
  } else {
    seg_base = static_cast<int64_t>(n) * ((p.T + kSeg - 1) / kSeg);
  }
  const int nseg = static_cast<int>((len + kSeg - 1) / kSeg);
  auto ckpt_at = [&](int c) {
    return bp.ckpt + (((seg_base + c) * p.HV + hv) * bp.tiles + tile) * static_cast<int64_t>(kThreads) * kPerThread +
           tid * kPerThread;
  };
  float* scratch = bp.scratch + static_cast<int64_t>(blockIdx.x) * kSeg * kThreads * kPerThread + tid * kPerThread;
  const TokenReader<EPL> reader{bp, b_row, h, hv, k0, j0};
  auto row_ok = [&](int r) { return j0 + r < p.V; };

  // a. forward with checkpoints
  float s[kRows][EPL];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e)
      s[r][e] = (p.h0 && row_ok(r)) ? ld(p.h0, p.h0_dt, state_elem(p, n, hv, j0 + r, k0 + e)) : 0.0f;
  {
    Token<EPL> x, nxt;
    if (len > 0) reader.read(x, bos, false);
    for (int64_t i = 0; i < len; ++i) {
      if (i + 1 < len) reader.read(nxt, bos + i + 1, false);
      if (i % kSeg == 0) save<EPL>(ckpt_at(static_cast<int>(i / kSeg)), s);
      forward_step<EPL>(s, x, p.delta, lane);
      x = nxt;
    }
  }

  // b. segments last to first
  float D[kRows][EPL];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < EPL; ++e)
      D[r][e] = (bp.dht && row_ok(r)) ? ld(bp.dht, bp.dht_dt, state_elem(p, n, hv, j0 + r, k0 + e)) : 0.0f;
  const int64_t row_stride = static_cast<int64_t>(p.HV) * (3 * K + 1);
  const int64_t tile_stride = bp.BT * row_stride;
  int buf = 0;
  for (int c = nseg - 1; c >= 0; --c) {
    const int64_t i0 = static_cast<int64_t>(c) * kSeg, i1 = min(len, i0 + kSeg);
    restore<EPL>(ckpt_at(c), s);
    Token<EPL> x, nxt;
    reader.read(x, bos + i0, false);
    for (int64_t i = i0; i < i1; ++i) {
      if (i + 1 < i1) reader.read(nxt, bos + i + 1, false);
      save<EPL>(scratch + (i - i0) * kThreads * kPerThread, s);
      forward_step<EPL>(s, x, p.delta, lane);
      x = nxt;
    }
    float sp_next[kRows][EPL];
    reader.read(x, bos + i1 - 1, true);
    restore<EPL>(scratch + (i1 - 1 - i0) * kThreads * kPerThread, sp_next);
    for (int64_t i = i1 - 1; i >= i0; --i) {
      const int64_t t = bos + i;
      float sp[kRows][EPL];  // S'_t = S_{t-1} * decay
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int e = 0; e < EPL; ++e) sp[r][e] = sp_next[r][e] * x.dec[e];
      if (i > i0) {
        reader.read(nxt, t - 1, true);
        restore<EPL>(scratch + (i - 1 - i0) * kThreads * kPerThread, sp_next);
      }
      const float(&dO)[kRows] = x.dO;
      float u[kRows];
      written_values<EPL>(sp, x, p.delta, u, lane);
      // o_t = S_t^T q^: dq^ = S_t dO, and D += q^ dO^T
      float dq[EPL], dk[EPL], da[EPL];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        float acc = 0;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          acc += (sp[r][e] + x.beta * x.k[e] * u[r]) * dO[r];
          D[r][e] += x.q[e] * dO[r];
        }
        dq[e] = acc;
      }
      float dvr[kRows], dbeta = 0;
      if (p.delta) {
        float w[kRows];  // D^T k
        row_dots<EPL>(D, x.k, w, lane);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          dbeta += w[r] * u[r];
          dvr[r] = x.beta * w[r];
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          float write = 0, read = 0;
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            write += D[r][e] * u[r];
            D[r][e] -= x.k[e] * dvr[r];
            read += sp[r][e] * dvr[r];
          }
          dk[e] = x.beta * write - read;
        }
      } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          float acc = 0;
#pragma unroll
          for (int r = 0; r < kRows; ++r) acc += D[r][e] * u[r];
          dk[e] = acc;
        }
        row_dots<EPL>(D, x.k, dvr, lane);
      }
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        float acc = 0;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          acc += sp[r][e] * D[r][e];
          D[r][e] *= x.dec[e];
        }
        da[e] = acc;
      }
      if (bp.dv && lane < kRows && row_ok(lane)) {
        float mine = dvr[0];
#pragma unroll
        for (int r = 1; r < kRows; ++r) mine = lane == r ? dvr[r] : mine;
        st(bp.dv, bp.dv_dt, b_row * bp.dv_s[0] + t * bp.dv_s[1] + hv * bp.dv_s[2] + (j0 + lane) * bp.dv_s[3], mine);
      }
      // the CTA's rows added up in shared memory, warp by warp in order
      float* mine = red[buf][warp];
#pragma unroll
      for (int e = 0; e < EPL; ++e) mine[k0 + e] = dq[e], mine[K + k0 + e] = dk[e], mine[2 * K + k0 + e] = da[e];
      if (lane == 0) mine[3 * K] = dbeta;
      __syncthreads();
      float* out = bp.part + tile * tile_stride + (static_cast<int64_t>(b_row) * p.T + t) * row_stride +
                   static_cast<int64_t>(hv) * (3 * K + 1);
      for (int idx = tid; idx < 3 * K + 1; idx += kThreads) {
        float acc = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) acc += red[buf][w][idx];
        out[idx] = acc;
      }
      buf ^= 1;
      x = nxt;
    }
  }
  if (bp.dh0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!row_ok(r)) continue;
#pragma unroll
      for (int e = 0; e < EPL; ++e) st(bp.dh0, bp.dh0_dt, state_elem(p, n, hv, j0 + r, k0 + e), D[r][e]);
    }
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
  int64_t BT;
  int T, H, HV, K, tiles, per_channel, gate_in_kernel, has_lb, delta, beta_sigmoid, l2norm, dt_bias_per_channel;
  float lb, beta_mult, scale;
};

// dq and dk of token f, q/k head h: the partial sums over row tiles and the group's value heads, in
// order, then the L2 norm's and the scale's chain rule. One thread per element of K.
__global__ void chain_qk_kernel(const ChainParams c) {
  __shared__ float shm[32];
  const int64_t f = blockIdx.x / c.H;
  const int h = static_cast<int>(blockIdx.x % c.H), i = threadIdx.x, G = c.HV / c.H;
  const int64_t b = f / c.T, t = f % c.T;
  const int64_t width = 3 * c.K + 1;
  for (int which = 0; which < 2; ++which) {
    void* dst = which == 0 ? c.dq : c.dk;
    if (!dst) continue;
    float dy = 0;
    for (int tl = 0; tl < c.tiles; ++tl)
      for (int g = 0; g < G; ++g) dy += c.part[((tl * c.BT + f) * c.HV + h * G + g) * width + which * c.K + i];
    const void* src = which == 0 ? c.q : c.k;
    const int64_t* s = which == 0 ? c.q_s : c.k_s;
    const float x = ld(src, which == 0 ? c.q_dt : c.k_dt, b * s[0] + t * s[1] + h * s[2] + i * s[3]);
    float dx = dy;
    if (c.l2norm) {
      const float ss = block_sum(x * x, shm), xdy = block_sum(x * dy, shm);
      const float rinv = rsqrtf(ss + 1e-6f);
      dx = rinv * dy - rinv * rinv * rinv * x * xdy;
    }
    if (which == 0) dx *= c.scale;
    st(dst, which == 0 ? c.dq_dt : c.dk_dt, (f * c.H + h) * static_cast<int64_t>(c.K) + i, dx);
  }
}

// dbeta and dg of token f, value head hv, and the terms of dA_log / d dt_bias. One thread per
// element of K.
__global__ void chain_gate_kernel(const ChainParams c) {
  __shared__ float shm[32];
  const int64_t f = blockIdx.x / c.HV;
  const int hv = static_cast<int>(blockIdx.x % c.HV), i = threadIdx.x;
  const int64_t b = f / c.T, t = f % c.T;
  const int64_t width = 3 * c.K + 1;
  float da = 0, db = 0;
  for (int tl = 0; tl < c.tiles; ++tl) {
    const float* row = c.part + ((tl * c.BT + f) * c.HV + hv) * width;
    da += row[2 * c.K + i];
    if (i == 0) db += row[3 * c.K];
  }
  if (c.delta && i == 0 && c.dbeta) {
    if (c.beta_sigmoid) {
      const float x = ld(c.beta, c.beta_dt, b * c.beta_s[0] + t * c.beta_s[1] + hv * c.beta_s[2]);
      const float sg = 1.0f / (1.0f + __expf(-x));
      db *= c.beta_mult * sg * (1.0f - sg);
    }
    st(c.dbeta, c.dbeta_dt, f * c.HV + hv, db);
  }
  if (!c.dg && !c.gate_in_kernel) return;
  float d = da;
  if (!c.per_channel) d = block_sum(da, shm);
  if (!c.per_channel && i != 0) return;
  float dg = d, alog = 0;
  if (c.gate_in_kernel) {
    float x = c.per_channel ? ld(c.g, c.g_dt, b * c.g_s[0] + t * c.g_s[1] + hv * c.g_s[2] + i * c.g_s[3])
                            : ld(c.g, c.g_dt, b * c.g_s[0] + t * c.g_s[1] + hv * c.g_s[2]);
    if (c.dt_bias) x += ld(c.dt_bias, c.dt_bias_dt, c.dt_bias_per_channel ? hv * c.K + i : hv);
    if (c.has_lb) {
      const float e = c.A_log ? expf(ld(c.A_log, c.A_log_dt, hv)) : 1.0f;
      const float z = e * x, sg = 1.0f / (1.0f + expf(-z));
      const float dz = d * c.lb * sg * (1.0f - sg);
      dg = dz * e;
      alog = c.A_log ? dz * z : 0.0f;
    } else {
      const float e = expf(ld(c.A_log, c.A_log_dt, hv));
      dg = -d * e / (1.0f + expf(-x));
      alog = -d * e * (x > 20.0f ? x : log1pf(expf(x)));
    }
    const int n_raw = c.per_channel ? c.K : 1;
    c.gate_raw[(f * c.HV + hv) * n_raw + (c.per_channel ? i : 0)] = dg;
  }
  if (c.dg) st(c.dg, c.dg_dt, c.per_channel ? (f * c.HV + hv) * static_cast<int64_t>(c.K) + i : f * c.HV + hv, dg);
  if (c.gate_in_kernel) {
    if (c.per_channel) alog = block_sum(alog, shm);
    if (i == 0) c.alog[f * c.HV + hv] = alog;
  }
}

// dA_log[hv] and d dt_bias[hv, .]: the tokens' terms added in token order. One CTA per value head.
__global__ void param_sum_kernel(const ChainParams c, void* dA_log, int dA_log_dt, void* ddt, int ddt_dt) {
  __shared__ float shm[32];
  const int hv = blockIdx.x;
  const int n_raw = c.per_channel ? c.K : 1;
  if (ddt) {
    for (int i = threadIdx.x; i < n_raw; i += blockDim.x) {
      float s = 0;
      for (int64_t f = 0; f < c.BT; ++f) s += c.gate_raw[(f * c.HV + hv) * n_raw + i];
      st(ddt, ddt_dt, static_cast<int64_t>(hv) * n_raw + i, s);
    }
  }
  if (dA_log) {
    float s = 0;
    for (int64_t f = threadIdx.x; f < c.BT; f += blockDim.x) s += c.alog[f * c.HV + hv];
    s = block_sum(s, shm);
    if (threadIdx.x == 0) st(dA_log, dA_log_dt, hv, s);
  }
}

// Zeros of a parameter gradient the gate does not reach (gate not in kernel).
__global__ void zero_kernel(void* p, int dt, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    st(p, dt, i, 0.0f);
}

void check(cudaError_t e, const char* what) { cuda_check(e, "chunk_bwd", what); }

int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

// The forward's arguments from the backward's inputs (out, final state and pools unused): the
// forward's parameters and its rules for inputs the CUDA kernels read.
cula_chunk_fwd_args forward_args(const cula_chunk_bwd_args& a) {
  cula_chunk_fwd_args fa{};
  fa.struct_size = sizeof(fa);
  fa.opt = a.opt;
  fa.q = a.q, fa.k = a.k, fa.v = a.v, fa.g = a.g, fa.beta = a.beta, fa.decay = a.decay;
  fa.A_log = a.A_log, fa.dt_bias = a.dt_bias, fa.cu_seqlens = a.cu_seqlens, fa.initial_state = a.initial_state;
  fa.out = const_cast<cula_tensor*>(a.d_out);  // read only: its strides, not written
  return fa;
}

}  // namespace

Refusal cuda_recurrent_bwd_declines(const Recurrence& r, const cula_chunk_bwd_args& a) {
  if (r.K != 64 && r.K != 128 && r.K != 256)
    return Refusal::unsupported("the CUDA backward takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                                "; use host tensors (the CPU reference) for other head sizes");
  // the forward's rules for inputs the CUDA kernels read (device offsets, contiguous parameters)
  if (const UnreadableInput u = first_unreadable_input(forward_args(a)); u.name) return Refusal::bad_argument(u.name, u.expected, u.given);
  if (a.d_final_state && !is_contiguous(*a.d_final_state))
    return Refusal::bad_argument("d_final_state", "a contiguous tensor for the CUDA kernel", "a strided view");
  return Refusal::takes();
}

void cuda_recurrent_bwd(const Recurrence& r, const cula_chunk_bwd_args& a) {
  const char* op = "chunk_bwd";
  const cula_chunk_fwd_args fa = forward_args(a);
  BwdParams bp{};
  bp.f = make_fwd_params(r, fa);
  bp.dO = a.d_out->data, bp.dO_dt = a.d_out->dtype;
  strides4(a.d_out, bp.dO_s);
  if (a.d_final_state) bp.dht = a.d_final_state->data, bp.dht_dt = a.d_final_state->dtype;
  if (a.d_initial_state) bp.dh0 = a.d_initial_state->data, bp.dh0_dt = a.d_initial_state->dtype;

  const int device = a.q->device_id;
  check(cudaSetDevice(device), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const int64_t BT = r.B * r.T, K = r.K, V = r.V;
  const int per_channel = r.tr.gate == GateKind::PerChannel;
  const int64_t n_raw = per_channel ? K : 1;
  bp.tiles = static_cast<int>((V + kTileRows - 1) / kTileRows);
  const int64_t ctas = r.N * r.HV * bp.tiles;
  if (ctas >= (int64_t{1} << 31)) throw_unsupported(op, "too many sequences x heads for one launch");
  const int64_t segs = a.cu_seqlens ? r.T / kSeg + r.N : r.N * ((r.T + kSeg - 1) / kSeg);
  const int64_t per_cta = int64_t{kThreads} * kRows * (K / 32);  // floats of one CTA's state rows
  const int64_t ckpt_bytes = align256(segs * r.HV * bp.tiles * per_cta * 4);
  const int64_t scratch_bytes = align256(ctas * kSeg * per_cta * 4);
  const int64_t part_bytes = align256(bp.tiles * BT * r.HV * (3 * K + 1) * 4);
  const int64_t raw_bytes = r.gate_in_kernel ? align256(BT * r.HV * n_raw * 4) + align256(BT * r.HV * 4) : 0;
  const int64_t qk_bytes = align256(BT * r.H * K * 4), dec_bytes = align256(BT * r.HV * K * 4);
  const int64_t prep_bytes = 2 * qk_bytes + dec_bytes + align256(BT * r.HV * 4);
  chunk::Workspace ws(ckpt_bytes + scratch_bytes + part_bytes + raw_bytes + prep_bytes, device, stream, op);
  char* w = static_cast<char*>(ws.get());
  char* prep = w + ckpt_bytes + scratch_bytes + part_bytes + raw_bytes;
  bp.qh = reinterpret_cast<float*>(prep);
  bp.kh = reinterpret_cast<float*>(prep + qk_bytes);
  bp.dec = reinterpret_cast<float*>(prep + 2 * qk_bytes);
  bp.beta = reinterpret_cast<float*>(prep + 2 * qk_bytes + dec_bytes);
  bp.ckpt = reinterpret_cast<float*>(w);
  bp.scratch = reinterpret_cast<float*>(w + ckpt_bytes);
  bp.part = reinterpret_cast<float*>(w + ckpt_bytes + scratch_bytes);
  float* gate_raw = r.gate_in_kernel ? reinterpret_cast<float*>(w + ckpt_bytes + scratch_bytes + part_bytes) : nullptr;
  float* alog = r.gate_in_kernel ? gate_raw + align256(BT * r.HV * n_raw * 4) / 4 : nullptr;
  if (a.dv) bp.dv = a.dv->data, bp.dv_dt = a.dv->dtype, strides4(a.dv, bp.dv_s);
  bp.BT = BT;

  if (BT * std::max(r.H, r.HV) >= (int64_t{1} << 31)) throw_unsupported(op, "too many tokens x heads for one launch");
  if (BT > 0) prepare_tokens_kernel<<<static_cast<unsigned>(BT * r.HV), static_cast<unsigned>(K), 0, stream>>>(bp);
  const unsigned grid = static_cast<unsigned>(ctas);
  const int smem = static_cast<int>(2 * kWarps * (3 * K + 1) * sizeof(float));
  auto launch = [&](auto kernel) {
    chunk::allow_smem(kernel, smem);
    kernel<<<grid, kThreads, smem, stream>>>(bp);
  };
  if (grid > 0) switch (r.K) {
    case 64: launch(recurrent_bwd_kernel<2>); break;
    case 128: launch(recurrent_bwd_kernel<4>); break;
    default: launch(recurrent_bwd_kernel<8>); break;
  }
  check(cudaGetLastError(), "kernel launch");

  ChainParams c{};
  const FwdParams& p = bp.f;
  c.q = p.q, c.k = p.k, c.g = p.g, c.beta = p.beta, c.A_log = p.A_log, c.dt_bias = p.dt_bias;
  c.q_dt = p.q_dt, c.k_dt = p.k_dt, c.g_dt = p.g_dt, c.beta_dt = p.beta_dt, c.A_log_dt = p.A_log_dt,
  c.dt_bias_dt = p.dt_bias_dt;
  std::copy(p.q_s, p.q_s + 4, c.q_s), std::copy(p.k_s, p.k_s + 4, c.k_s), std::copy(p.g_s, p.g_s + 4, c.g_s);
  std::copy(p.beta_s, p.beta_s + 3, c.beta_s);
  if (a.dq) c.dq = a.dq->data, c.dq_dt = a.dq->dtype;
  if (a.dk) c.dk = a.dk->data, c.dk_dt = a.dk->dtype;
  if (a.dg) c.dg = a.dg->data, c.dg_dt = a.dg->dtype;
  if (a.dbeta) c.dbeta = a.dbeta->data, c.dbeta_dt = a.dbeta->dtype;
  c.part = bp.part, c.gate_raw = gate_raw, c.alog = alog;
  c.BT = BT, c.T = static_cast<int>(r.T), c.H = static_cast<int>(r.H), c.HV = static_cast<int>(r.HV);
  c.K = static_cast<int>(K), c.tiles = bp.tiles, c.per_channel = per_channel, c.gate_in_kernel = r.gate_in_kernel;
  c.has_lb = r.has_lb, c.delta = r.tr.delta, c.beta_sigmoid = r.beta_sigmoid, c.l2norm = r.l2norm;
  c.dt_bias_per_channel = r.dt_bias_per_channel;
  c.lb = static_cast<float>(r.lb), c.beta_mult = r.neg_eig ? 2.0f : 1.0f, c.scale = static_cast<float>(r.scale);
  if (BT > 0 && (a.dq || a.dk)) chain_qk_kernel<<<static_cast<unsigned>(BT * r.H), static_cast<unsigned>(K), 0, stream>>>(c);
  if (BT > 0 && (a.dbeta || a.dg || r.gate_in_kernel))
    chain_gate_kernel<<<static_cast<unsigned>(BT * r.HV), static_cast<unsigned>(K), 0, stream>>>(c);
  if (a.dA_log || a.ddt_bias) {
    if (r.gate_in_kernel) {
      param_sum_kernel<<<static_cast<unsigned>(r.HV), 256, 0, stream>>>(c, a.dA_log ? a.dA_log->data : nullptr,
                                                                         a.dA_log ? a.dA_log->dtype : 0,
                                                                         a.ddt_bias ? a.ddt_bias->data : nullptr,
                                                                         a.ddt_bias ? a.ddt_bias->dtype : 0);
    } else {
      for (cula_tensor* t : {a.dA_log, a.ddt_bias})
        if (t) zero_kernel<<<8, 256, 0, stream>>>(t->data, t->dtype, numel(*t));
    }
  }
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  check(launched, "kernel launch");
}

}  // namespace cula
