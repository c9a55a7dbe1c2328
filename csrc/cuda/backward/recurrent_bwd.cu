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
// Four kernels (0, 2 and 3 shared with the chunk form, in chain.cu):
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
#include "cuda/backward/block_sum.cuh"
#include "cuda/backward/chain.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/check.h"

namespace cula {
namespace {

using dev::ld;
using dev::st;
using bwd::align256;
using bwd::block_sum;

constexpr int kWarps = 8;
constexpr int kRows = 4;                   // state rows per warp
constexpr int kTileRows = kWarps * kRows;  // rows per CTA
constexpr int kThreads = kWarps * 32;
constexpr int kSeg = 16;  // tokens per checkpoint segment

struct BwdParams {
  FwdParams f;  // the forward's inputs and options (out, final state, pool unused)
  bwd::GradIO io;  // d_out, d_final_state, d_initial_state, dv
  int64_t BT;        // tokens (B*T)
  int tiles;         // row tiles along V
  float* ckpt;       // [segments, HV, tiles, kThreads, kRows, EPL]
  float* scratch;    // [CTAs, kSeg, kThreads, kRows, EPL]
  float* part;       // [tiles, B*T, HV, 3K + 1]: dq^, dk^, da partial sums and dbeta
  bwd::TokenInputs x;  // the tokens' inputs (chain.h), the decay as e^a
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
    vec(bp.x.qh + (f * p.H + h) * K + k0, x.q);
    vec(bp.x.kh + (f * p.H + h) * K + k0, x.k);
    vec(bp.x.dec + (f * p.HV + hv) * K + k0, x.dec);
    x.beta = bp.x.beta[f * p.HV + hv];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool ok = j0 + r < p.V;
      x.v[r] = ok ? ld(p.v, p.v_dt, b_row * p.v_s[0] + t * p.v_s[1] + hv * p.v_s[2] + (j0 + r) * p.v_s[3]) : 0.0f;
      x.dO[r] = ok && with_dO ? ld(bp.io.dO, bp.io.dO_dt, b_row * bp.io.dO_s[0] + t * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + (j0 + r) * bp.io.dO_s[3])
                              : 0.0f;
    }
  }
};

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
      D[r][e] = (bp.io.dht && row_ok(r)) ? ld(bp.io.dht, bp.io.dht_dt, state_elem(p, n, hv, j0 + r, k0 + e)) : 0.0f;
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
      if (bp.io.dv && lane < kRows && row_ok(lane)) {
        float mine = dvr[0];
#pragma unroll
        for (int r = 1; r < kRows; ++r) mine = lane == r ? dvr[r] : mine;
        st(bp.io.dv, bp.io.dv_dt, b_row * bp.io.dv_s[0] + t * bp.io.dv_s[1] + hv * bp.io.dv_s[2] + (j0 + lane) * bp.io.dv_s[3], mine);
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
  if (bp.io.dh0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!row_ok(r)) continue;
#pragma unroll
      for (int e = 0; e < EPL; ++e) st(bp.io.dh0, bp.io.dh0_dt, state_elem(p, n, hv, j0 + r, k0 + e), D[r][e]);
    }
  }
}

}  // namespace

Refusal cuda_recurrent_bwd_declines(const Recurrence& r, const cula_chunk_bwd_args& a) {
  if (r.K != 64 && r.K != 128 && r.K != 256)
    return Refusal::unsupported("the CUDA backward takes K in {64, 128, 256}, got K = " + std::to_string(r.K) +
                                "; use host tensors (the CPU reference) for other head sizes");
  // the forward's rules for inputs the CUDA kernels read (device offsets, contiguous parameters)
  if (const UnreadableInput u = first_unreadable_input(bwd::forward_args(a)); u.name) return Refusal::bad_argument(u.name, u.expected, u.given);
  if (a.d_final_state && !is_contiguous(*a.d_final_state))
    return Refusal::bad_argument("d_final_state", "a contiguous tensor for the CUDA kernel", "a strided view");
  return Refusal::takes();
}

void cuda_recurrent_bwd(const Recurrence& r, const cula_chunk_bwd_args& a) {
  const char* op = "chunk_bwd";
  const cula_chunk_fwd_args fa = bwd::forward_args(a);
  BwdParams bp{};
  bp.f = make_fwd_params(r, fa);
  bp.io = bwd::grad_io(a);

  const int device = a.q->device_id;
  bwd::check(cudaSetDevice(device), "cudaSetDevice");
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const int64_t BT = r.B * r.T, K = r.K, V = r.V;
  bp.tiles = static_cast<int>((V + kTileRows - 1) / kTileRows);
  const int64_t ctas = r.N * r.HV * bp.tiles;
  if (ctas >= (int64_t{1} << 31)) throw_unsupported(op, "too many sequences x heads for one launch");
  const int64_t segs = a.cu_seqlens ? r.T / kSeg + r.N : r.N * ((r.T + kSeg - 1) / kSeg);
  const int64_t per_cta = int64_t{kThreads} * kRows * (K / 32);  // floats of one CTA's state rows
  const int64_t ckpt_bytes = align256(segs * r.HV * bp.tiles * per_cta * 4);
  const int64_t scratch_bytes = align256(ctas * kSeg * per_cta * 4);
  const int64_t part_bytes = align256(bp.tiles * BT * r.HV * bwd::part_width(K) * 4);
  const int64_t chain_bytes = bwd::chain_bytes(r);
  chunk::Workspace ws(ckpt_bytes + scratch_bytes + part_bytes + chain_bytes + bwd::token_inputs_bytes(r), device, stream, op);
  char* w = static_cast<char*>(ws.get());
  bp.ckpt = reinterpret_cast<float*>(w);
  bp.scratch = reinterpret_cast<float*>(w + ckpt_bytes);
  bp.part = reinterpret_cast<float*>(w + ckpt_bytes + scratch_bytes);
  void* chain_ws = w + ckpt_bytes + scratch_bytes + part_bytes;
  bp.x = bwd::token_inputs_at(w + ckpt_bytes + scratch_bytes + part_bytes + chain_bytes, r);
  bp.BT = BT;

  bwd::launch_token_inputs(bp.f, bp.x, /*log_decay=*/false, stream);
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
  bwd::check(cudaGetLastError(), "kernel launch");
  bwd::launch_chain(r, a, bp.f, bp.part, bp.tiles, chain_ws, stream);
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  bwd::check(launched, "kernel launch");
}

}  // namespace cula
