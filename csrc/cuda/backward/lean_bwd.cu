// The chunk backward's lean form: no delta rule, one decay per token (simple GLA's scalar gate,
// Lightning's constant), K <= 128. Without the delta rule a chunk's gradients need only its start
// state S0 and the gradient dS of its end state, so the general form's factor block, scan inputs
// and part-row passes (chunk_bwd.cu) drop out. Per chunk of C = 64 tokens, G_t the inclusive
// cumulative log-decay in the chunk, g = G at its last token, E_ts = e^{G_t - G_s} (s <= t):
//
//   S_end  = e^g S0 + sum_s e^{g - G_s} k^_s v_s^T          dS0 = e^g dS + sum_t e^{G_t} q^_t dO_t^T
//   A      = (q^ k^T) o E,  dP = (dO v^T) o E   (lower triangle, the diagonal included)
//   dq^_t  = e^{G_t} (dO S0^T)_t + sum_s dP_ts k^_s
//   dk^_s  = e^{g - G_s} (v dS^T)_s + sum_t dP_ts q^_t
//   dv_s   = sum_t A_ts dO_t + e^{g - G_s} (dS^T k^_s)
//   dG_t   = q^_t o dq^_t - k^_t o dk^_t  (+ at the last token, S_end o dS summed over V)
//   da_s   = sum_{t >= s} dG_t
//
// Kernels, in stream order (one workspace: the token inputs, S0 and dS per chunk in fp32, the part rows):
//  1. prepare_tokens_kernel (chain.cu): q^, k^ and the log-decay a.
//  2. lean_scans_kernel, per (sequence, value head, VS columns) x 2 roles on alternate CTAs, 8 warps,
//     two CTAs per SM: chunks in order, S0 of each chunk, S <- e^g S + (k^ e^{g - G})^T v; chunks last
//     to first, dS of each chunk's end, dS <- e^g dS + (q^ e^G)^T dO; dh0 at the end. One product a
//     step; the next chunk's k^ (or q^) tile, its v (or dO) rows as they lie in memory and its
//     log-decays come by cp.async during the step (double buffers); a step converts its rows to fp32
//     and warp 0 scans the log-decays, then the product, whose epilogue writes the carried slice out
//     and updates it (each element one thread's, so no extra barrier).
//  3. lean_grads_kernel, per (chunk, value head), 16 warps, one CTA per SM (192 KB at K = 128):
//     q^, k^ and A once; then over V in slices of 64 columns (v, dO, S0, dS): dP, dO S0^T and v dS^T
//     accumulated in registers (tf32::Acc), the channel sums S0 o dS, and the slice's dv (A^T dO +
//     (k^ e^{g - G}) dS) written out; then dP o E with its diagonal set aside, dq^ and dk^ as two
//     products of one shape (so the thread that writes an element of dG in the first adds to it in
//     the second, no barrier), and the part rows written once: dq^, dk^, da (a reverse sum by
//     segments). The diagonal pairs stay out of the products: their dG terms cancel exactly, their
//     dq^ / dk^ terms (dP_tt k^_t, dP_tt q^_t) are added in fp32 at the write back.
//  4. the chain kernels (chain.cu), as the general form.
// Products: tf32_gemm.cuh (fp32 operands in shared memory; one TF32 product on bf16 inputs, three
// otherwise, as chunk_bwd.cu decides). Deterministic: every sum in a fixed order, no atomics.
#include "cuda/backward/lean_bwd.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/backward/chain.h"
#include "cuda/backward/chunk_tiles.cuh"
#include "cuda/backward/lean_plan.h"
#include "cuda/backward/scan_width.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/kerutils/bf16_gemm.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/kerutils/tf32_gemm.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace {

using bwd::ChunkAt;
using bwd::ColsScaled;
using bwd::fast_exp;
using bwd::RowScaled;
using bwd::rows_async;
using tf32::cols;
using tf32::rows;

constexpr int C = kChunk;                // 64 tokens
constexpr int NW = 16, NT = 32 * NW;     // the grads kernel
constexpr int SW = 8, ST = 32 * SW;      // the scans
constexpr int VE = 64;                   // columns of V per slice of the grads kernel

struct LeanParams {
  FwdParams f;
  bwd::TokenInputs x;   // q^, k^ and the log-decay a (x.dec, repeated over K)
  int32_t* chunk_base;  // varlen chunk numbering, else null
  void* S0;             // states at chunk starts [chunks, HV, K, V], fp32 (bf16 on the bf16 path)
  void* dS;             // end-state gradients [chunks, HV, K, V], as S0
  float* part;          // [B*T, HV, 3K + 1] (chain.h)
  bwd::GradIO io;       // d_out, d_final_state, d_initial_state, dv
  int want_da;          // the gate has a gradient (simple GLA; Lightning's constant decay has none)
  // the direct path (lean_plan.h): dq, dk and dg written by the gradient kernel, null where not asked
  void *dq, *dk, *dg;
  int dq_dt, dk_dt, dg_dt;
};

__host__ __device__ inline int elem_bytes(int dt) { return dt == CULA_FLOAT32 ? 4 : 2; }

// G_t = a_0 + ... + a_t for the chunk's 64 tokens (a = 0 past the chunk's end, so G_63 = g), by one
// warp: lane l holds tokens l and l + 32. Returns g; G0, G1 are the lane's two values.
__device__ __forceinline__ float chunk_cumsum(float a0, float a1, int lane, float& G0, float& G1) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float x0 = __shfl_up_sync(0xffffffffu, a0, d), x1 = __shfl_up_sync(0xffffffffu, a1, d);
    if (lane >= d) a0 += x0, a1 += x1;
  }
  const float half = __shfl_sync(0xffffffffu, a0, 31);
  G0 = a0, G1 = a1 + half;
  return __shfl_sync(0xffffffffu, G1, 31);
}

// The gradient kernels' token vectors, by one warp from its lanes' log-decays (tokens lane and lane +
// 32, zero past Lc): G, e^G and e^{g - G} (zeros past Lc). Returns g.
__device__ __forceinline__ float chunk_decays(float a0, float a1, int lane, int Lc, float* Gs, float* eG, float* eK) {
  float G0, G1;
  const float g = chunk_cumsum(a0, a1, lane, G0, G1);
  Gs[lane] = G0, Gs[lane + 32] = G1;
  eG[lane] = lane < Lc ? fast_exp(G0) : 0.0f;
  eG[lane + 32] = lane + 32 < Lc ? fast_exp(G1) : 0.0f;
  eK[lane] = lane < Lc ? fast_exp(g - G0) : 0.0f;
  eK[lane + 32] = lane + 32 < Lc ? fast_exp(g - G1) : 0.0f;
  return g;
}

// Rows [0, valid) of a C x COLS bf16 matrix (16-byte aligned rows, row t at src + t row_stride) into a
// bf16 tile (pitch ld) by cp.async, as they lie (the caller commits); rows past valid zeroed.
template <int COLS, int THREADS>
__device__ __forceinline__ void bf16_rows_async(__nv_bfloat16* dst, int ld, const __nv_bfloat16* src, int64_t row_stride,
                                                int valid) {
  constexpr int P = COLS / 8;
  for (int i = threadIdx.x; i < C * P; i += THREADS) {
    const int t = i / P, c = (i % P) * 8;
    if (t < valid) mma::cp_async16(dst + t * ld + c, src + t * row_stride + c);
    else *reinterpret_cast<uint4*>(dst + t * ld + c) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// A token's log-decay (one per token: channel 0 of the repeated row).
__device__ __forceinline__ const float* decay_row(const LeanParams& bp, int64_t f, int hv) {
  return bp.x.dec + (f * bp.f.HV + hv) * static_cast<int64_t>(bp.f.K);
}

// The log-decay of token t (its position in sequence row b) and value head hv as the call gives it:
// the direct path's gates, a scalar one not activated in the kernel or Lightning's constant.
__device__ __forceinline__ float input_log_decay(const FwdParams& p, int b, int64_t t, int hv) {
  if (p.gate_kind == GateKind::Constant) return -bwd::ld(p.decay, p.decay_dt, p.decay_heads == p.HV ? hv : hv / (p.HV / p.H));
  return bwd::ld(p.g, p.g_dt, b * p.g_s[0] + t * p.g_s[1] + hv * p.g_s[2]);
}

// ---- 2. the scans ------------------------------------------------------------------------------
// Shared memory (floats, then the raw rows in the input's dtype): the carried slice S (K x VS), the
// k^ / q^ tiles (two, C x K), the step's rows in fp32 (C x VS), two log-decay rows, the token weights
// w (e^{g - G_t} or e^{G_t}) and e^g; then two raw row buffers of C x VS input elements.
template <int K, int VS>
struct LeanScanLayout {
  // pitches: the tiles are read down their columns as a product's A, the rows as its B (tf32_gemm.cuh)
  static constexpr int LS = VS + 8, LQ = K + 8;
  static constexpr int S = 0, X = S + K * LS, Vf = X + 2 * C * LQ, a = Vf + C * LS, w = a + 2 * C, eg = w + C,
                       floats = (eg + 1 + 3) / 4 * 4;
  static int bytes(int dt) { return floats * 4 + 2 * C * VS * elem_bytes(dt); }
};

// Rows [0, valid) of a C x VS tile of a bf16, fp16 or fp32 input, as they lie (16-byte aligned rows,
// row t at element off + t row_stride), into dst by cp.async; rows past valid zeroed.
template <int VS>
__device__ __forceinline__ void raw_rows_async(unsigned char* dst, const void* src, int es, int64_t off, int64_t row_stride,
                                               int valid) {
  const int P = VS * es / 16;  // 16-byte pieces a row
  const unsigned char* s = static_cast<const unsigned char*>(src) + off * es;
  for (int i = threadIdx.x; i < C * P; i += ST) {
    const int t = i / P, pc = i % P;
    unsigned char* d = dst + (t * P + pc) * 16;
    if (t < valid) mma::cp_async16(d, s + (t * row_stride) * es + pc * 16);
    else *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Both scans, one role per CTA (GRAD: the gradients, chunks last to first). The state role carries S
// (S0 out), k^ and v in, w_t = e^{g - G_t}; the gradient role carries dS (dS of each end out), q^ and
// dO in, w_t = e^{G_t}.
template <int K, int VS, int PREC, bool BF16, bool GRAD>
__device__ __forceinline__ void lean_scan(const LeanParams& bp, float* sm, const chunk::SliceTask& tk) {
  using Ly = LeanScanLayout<K, VS>;
  constexpr int LS = Ly::LS, LQ = Ly::LQ;
  const FwdParams& p = bp.f;
  float *S = sm + Ly::S, *Vf = sm + Ly::Vf, *w = sm + Ly::w, *eg = sm + Ly::eg;
  unsigned char* const raw0 = reinterpret_cast<unsigned char*>(sm + Ly::floats);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, hv = tk.hv, v0 = tk.v0, nch = tk.nchunks;
  const int h = hv / (p.HV / p.H);
  const void* in = GRAD ? bp.io.dO : p.v;
  const int dt = GRAD ? bp.io.dO_dt : p.v_dt, es = elem_bytes(dt);
  const int64_t* s4 = GRAD ? bp.io.dO_s : p.v_s;
  const float* tok = GRAD ? bp.x.qh : bp.x.kh;
  const int64_t qk_ld = static_cast<int64_t>(p.H) * K;
  void* const out = GRAD ? bp.dS : bp.S0;
  auto load = [&](int ci, int buf) {
    const ChunkAt ch = bwd::chunk_in(p, tk.sq, ci);
    rows_async<C, K, ST>(sm + Ly::X + buf * C * LQ, LQ, tok + (ch.f0 * p.H + h) * K, qk_ld, ch.Lc);
    raw_rows_async<VS>(raw0 + buf * C * VS * es, in, es, ch.b_row * s4[0] + ch.t0 * s4[1] + hv * s4[2] + v0, s4[1], ch.Lc);
    float* a = sm + Ly::a + buf * C;
    for (int t = tid; t < C; t += ST) {
      if (t < ch.Lc) mma::cp_async4(a + t, decay_row(bp, ch.f0 + t, hv));
      else a[t] = 0.0f;
    }
    mma::cp_async_commit();
  };
  bwd::slice_in<K, VS, ST>(S, LS, p, GRAD ? bp.io.dht : p.h0, GRAD ? bp.io.dht_dt : p.h0_dt, tk.n, hv, v0);
  if (nch > 0) load(GRAD ? nch - 1 : 0, 0);
  for (int s = 0; s < nch; ++s) {
    const int ci = GRAD ? nch - 1 - s : s, buf = s & 1;
    mma::cp_async_wait_all();
    __syncthreads();  // this chunk's rows in; the step before has read Vf and the other buffers, and written S
    if (s + 1 < nch) load(GRAD ? ci - 1 : ci + 1, buf ^ 1);
    const unsigned char* raw = raw0 + buf * C * VS * es;
    for (int i = tid; i < C * VS; i += ST) {
      const int t = i / VS, j = i % VS;
      Vf[t * LS + j] = dt == CULA_FLOAT32 ? reinterpret_cast<const float*>(raw)[i]
                                          : bwd::ld(raw, dt, static_cast<int64_t>(i));
    }
    if (warp == 0) {
      const float* a = sm + Ly::a + buf * C;
      float G0, G1;
      const float g = chunk_cumsum(a[lane], a[lane + 32], lane, G0, G1);
      const int Lc = bwd::chunk_in(p, tk.sq, ci).Lc;
      w[lane] = lane < Lc ? fast_exp(GRAD ? G0 : g - G0) : 0.0f;
      w[lane + 32] = lane + 32 < Lc ? fast_exp(GRAD ? G1 : g - G1) : 0.0f;
      if (lane == 0) *eg = fast_exp(g);
    }
    __syncthreads();
    const int64_t o = ((tk.cbase + ci) * p.HV + hv) * static_cast<int64_t>(K) * p.V + v0;
    const float e = *eg;
    tf32::gemm<K, VS, C, SW, 2, PREC>(ColsScaled{sm + Ly::X + buf * C * LQ, LQ, w}, rows(Vf, LS), [&](int i, int j, float v) {
      const float x = S[i * LS + j];
      const int64_t at = o + i * static_cast<int64_t>(p.V) + j;  // S0 of the chunk, or dS of its end
      if (BF16) static_cast<__nv_bfloat16*>(out)[at] = __float2bfloat16_rn(x);
      else static_cast<float*>(out)[at] = x;
      S[i * LS + j] = e * x + v;
    });
  }
  __syncthreads();
  if (GRAD && bp.io.dh0) bwd::slice_out<K, VS, ST>(bp.io.dh0, bp.io.dh0_dt, p, tk.n, hv, v0, S, LS);
}

template <int K, int VS, int PREC, bool BF16>
__global__ void __launch_bounds__(ST, 2) lean_scans_kernel(const LeanParams bp) {
  extern __shared__ __align__(16) float sm[];
  const chunk::SliceTask tk = chunk::slice_task<VS>(bp.f, bp.chunk_base, blockIdx.x >> 1);
  if (blockIdx.x & 1) lean_scan<K, VS, PREC, BF16, true>(bp, sm, tk);
  else lean_scan<K, VS, PREC, BF16, false>(bp, sm, tk);
}

// The direct path's scans (bf16 calls without the L2 norm in the kernel, one value head per q/k head,
// the gate not activated in the kernel): q, k, v, d_out and the gate read as they lie (no prepare
// pass), the products on bf16 operands with the carried slice in registers as their fp32
// accumulators (bf16_gemm.cuh). A step's left operand is the chunk's k (or q) tile as copied in, read
// MN-major; its right operand the v (or dO) rows times the token weights (e^{g - G_t}, or scale
// e^{G_t}), converted once into a bf16 tile. A step: wait for the chunk's copies, barrier, the next
// chunk's copies issued (its log-decays into registers); every warp scans the chunk's log-decays
// itself, converts its piece of the scaled rows and writes its part of the carried slice out (S0, or
// dS of the chunk's end, bf16), then scales it by e^g; barrier; the product accumulates onto it.
template <int K, int VS>
struct LeanDirectScanLayout {  // bytes: two k (q) tiles, two raw row buffers, the scaled rows, two log-decay rows
  static constexpr int LK = K + 8, LB = VS + 8;
  static constexpr int X = 0, R = X + 2 * C * LK * 2, B = R + 2 * C * VS * 2, a = B + C * LB * 2, bytes = a + 2 * C * 4;
};

template <int K, int VS, bool GRAD>
__device__ __forceinline__ void lean_direct_scan(const LeanParams& bp, unsigned char* sm, const chunk::SliceTask& tk) {
  using Ly = LeanDirectScanLayout<K, VS>;
  using bf = __nv_bfloat16;
  constexpr int LK = Ly::LK, LB = Ly::LB;
  static_assert(C * VS / 8 <= ST, "one piece of the scaled rows a thread");
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, lane = tid & 31, hv = tk.hv, v0 = tk.v0, nch = tk.nchunks;
  const bf* xsrc = static_cast<const bf*>(GRAD ? p.q : p.k);
  const int64_t* xs = GRAD ? p.q_s : p.k_s;
  const bf* rsrc = static_cast<const bf*>(GRAD ? bp.io.dO : p.v);
  const int64_t* rs = GRAD ? bp.io.dO_s : p.v_s;
  bf* const Bt = reinterpret_cast<bf*>(sm + Ly::B);
  float* const arow = reinterpret_cast<float*>(sm + Ly::a);
  auto load = [&](int ci, int buf) {
    const ChunkAt ch = bwd::chunk_in(p, tk.sq, ci);
    // (one value head per q/k head)
    bf16_rows_async<K, ST>(reinterpret_cast<bf*>(sm + Ly::X) + buf * C * LK, LK,
                           xsrc + ch.b_row * xs[0] + ch.t0 * xs[1] + hv * xs[2], xs[1], ch.Lc);
    bf16_rows_async<VS, ST>(reinterpret_cast<bf*>(sm + Ly::R) + buf * C * VS, VS,
                            rsrc + ch.b_row * rs[0] + ch.t0 * rs[1] + hv * rs[2] + v0, rs[1], ch.Lc);
    mma::cp_async_commit();
    return tid < ch.Lc ? input_log_decay(p, ch.b_row, ch.t0 + tid, hv) : 0.0f;  // (threads below C keep it)
  };
  // the carried slice from h0 (or dht), zeros without one
  bf16mm::Acc<K, VS, SW> S;
  {
    const void* src = GRAD ? bp.io.dht : p.h0;
    const int dt = GRAD ? bp.io.dht_dt : p.h0_dt;
    S.each([&](int i, int j, float& x0, float& x1) {
      x0 = src ? bwd::ld(src, dt, state_elem(p, tk.n, hv, v0 + j, i)) : 0.0f;
      x1 = src ? bwd::ld(src, dt, state_elem(p, tk.n, hv, v0 + j + 1, i)) : 0.0f;
    });
  }
  if (nch > 0) {
    const float a = load(GRAD ? nch - 1 : 0, 0);
    if (tid < C) arow[tid] = a;
  }
  bf* const out = static_cast<bf*>(GRAD ? bp.dS : bp.S0);
  const float wscale = GRAD ? p.scale : 1.0f;
  for (int s = 0; s < nch; ++s) {
    const int ci = GRAD ? nch - 1 - s : s, buf = s & 1;
    mma::cp_async_wait_all();
    __syncthreads();  // this chunk's tiles and log-decays in; the step before has read the scaled rows
    float a_next = 0.0f;
    if (s + 1 < nch) a_next = load(GRAD ? ci - 1 : ci + 1, buf ^ 1);
    const float* a = arow + buf * C;
    float G0, G1;
    const float g = chunk_cumsum(a[lane], a[lane + 32], lane, G0, G1);
    const int Lc = bwd::chunk_in(p, tk.sq, ci).Lc;
    const float w0 = lane < Lc ? wscale * fast_exp(GRAD ? G0 : g - G0) : 0.0f,
                w1 = lane + 32 < Lc ? wscale * fast_exp(GRAD ? G1 : g - G1) : 0.0f;
    {  // the scaled rows: thread tid its 8 columns of row t
      const int t = tid / (VS / 8), c = (tid % (VS / 8)) * 8;
      const float x0 = __shfl_sync(0xffffffffu, w0, t & 31), x1 = __shfl_sync(0xffffffffu, w1, t & 31);
      if (tid < C * VS / 8) {
        const float w = t < 32 ? x0 : x1;
        const uint4 r = *reinterpret_cast<const uint4*>(reinterpret_cast<const bf*>(sm + Ly::R) + buf * C * VS + t * VS + c);
        const uint32_t rw[4] = {r.x, r.y, r.z, r.w};
        uint32_t o[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const float2 f = mma::unpack(rw[m]);
          o[m] = mma::pack(w * f.x, w * f.y);
        }
        *reinterpret_cast<uint4*>(Bt + t * LB + c) = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
    const float eg = fast_exp(g);
    bf* const o = out + ((tk.cbase + ci) * p.HV + hv) * static_cast<int64_t>(K) * p.V + v0;
    S.each([&](int i, int j, float& x0, float& x1) {
      *reinterpret_cast<uint32_t*>(o + i * static_cast<int64_t>(p.V) + j) = mma::pack(x0, x1);  // S0, or dS of the end
      x0 *= eg, x1 *= eg;
    });
    __syncthreads();  // the scaled rows written
    S.template add<C>(bf16mm::mnmajor(reinterpret_cast<const bf*>(sm + Ly::X) + buf * C * LK, LK), bf16mm::mnmajor(Bt, LB));
    if (tid < C && s + 1 < nch) arow[(buf ^ 1) * C + tid] = a_next;
  }
  if (GRAD && bp.io.dh0)
    S.each([&](int i, int j, float& x0, float& x1) {
      bwd::st(bp.io.dh0, bp.io.dh0_dt, state_elem(p, tk.n, hv, v0 + j, i), x0);
      bwd::st(bp.io.dh0, bp.io.dh0_dt, state_elem(p, tk.n, hv, v0 + j + 1, i), x1);
    });
}

template <int K, int VS>
__global__ void __launch_bounds__(ST, 2) lean_direct_scans_kernel(const LeanParams bp) {
  extern __shared__ __align__(128) unsigned char smd[];
  const chunk::SliceTask tk = chunk::slice_task<VS>(bp.f, bp.chunk_base, blockIdx.x >> 1);
  if (blockIdx.x & 1) lean_direct_scan<K, VS, true>(bp, smd, tk);
  else lean_direct_scan<K, VS, false>(bp, smd, tk);
}

// ---- 3. the gradients --------------------------------------------------------------------------
// Shared memory (floats): q^ and k^ (C x K), A and then dP o E (C x C); the slice region: v, dO
// (C x VE), S0 and dS (K x VE) while the slices run, then dq^, dk^ and dG (C x K); the token vectors
// G, e^G, e^{g - G}, dP_tt, the last token's terms per channel and the reverse sum's segment totals.
template <int K>
struct LeanGradsLayout {
  static constexpr int LK = K + 4, LA = C + 4, LV = VE + 4;
  static constexpr int q = 0, k = q + C * LK, A = k + C * LK, slices = A + C * LA, v = slices, dO = v + C * LV,
                       S0 = dO + C * LV, dS = S0 + K * LV, dq = slices, dk = dq + C * LK, dG = dk + C * LK;
  static constexpr int slice_floats = (2 * C + 2 * K) * LV > 3 * C * LK ? (2 * C + 2 * K) * LV : 3 * C * LK;
  static constexpr int G = slices + slice_floats, eG = G + C, eK = eG + C, dPd = eK + C, last = dPd + C, seg = last + K,
                       floats = seg + NT;
  static constexpr int bytes = floats * 4;
};

template <int K, int PREC>
__global__ void __launch_bounds__(NT, 1) lean_grads_kernel(const LeanParams bp) {
  using Ly = LeanGradsLayout<K>;
  constexpr int LK = Ly::LK, LA = Ly::LA, LV = Ly::LV;
  constexpr int64_t PW = bwd::part_width(K);
  extern __shared__ __align__(16) float sm[];
  float *qs = sm + Ly::q, *ks = sm + Ly::k, *Am = sm + Ly::A, *vb = sm + Ly::v, *dOb = sm + Ly::dO, *S0b = sm + Ly::S0,
        *dSb = sm + Ly::dS;
  float *Gs = sm + Ly::G, *eG = sm + Ly::eG, *eK = sm + Ly::eK, *dPd = sm + Ly::dPd, *last = sm + Ly::last;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int cidx = static_cast<int>(blockIdx.x / p.HV), hv = static_cast<int>(blockIdx.x % p.HV);
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!bwd::chunk_at(p, bp.chunk_base, cidx, ch)) return;
  const int Lc = ch.Lc;
  const int64_t qk_ld = static_cast<int64_t>(p.H) * K, st_off = (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V;
  const bool want_dv = bp.io.dv != nullptr;

  auto load_slice = [&](int v0) {
    rows_async<K, VE>(S0b, LV, static_cast<const float*>(bp.S0) + st_off + v0, p.V);
    rows_async<K, VE>(dSb, LV, static_cast<const float*>(bp.dS) + st_off + v0, p.V);
    mma::cp_async_commit();
    bwd::input_rows<C, VE>(vb, LV, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0, p.v_s[1], Lc);
    bwd::input_rows<C, VE>(dOb, LV, bp.io.dO, bp.io.dO_dt,
                           ch.b_row * bp.io.dO_s[0] + ch.t0 * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0, bp.io.dO_s[1], Lc);
    mma::cp_async_wait_all();
  };
  rows_async<C, K>(qs, LK, bp.x.qh + (ch.f0 * p.H + h) * K, qk_ld, Lc);
  rows_async<C, K>(ks, LK, bp.x.kh + (ch.f0 * p.H + h) * K, qk_ld, Lc);
  if (warp == 0) {
    const float a0 = lane < Lc ? *decay_row(bp, ch.f0 + lane, hv) : 0.0f;
    const float a1 = lane + 32 < Lc ? *decay_row(bp, ch.f0 + lane + 32, hv) : 0.0f;
    const float g = chunk_decays(a0, a1, lane, Lc, Gs, eG, eK);
    if (lane == 0) last[0] = g;  // (read into a register below, before last is written)
  }
  load_slice(0);
  __syncthreads();
  const float eg = fast_exp(last[0]);
  // A = (q^ k^T) o E, the diagonal included
  tf32::gemm<C, C, K, NW, 2, PREC>(rows(qs, LK), cols(ks, LK), [&](int t, int s, float v) {
    Am[t * LA + s] = s <= t ? v * fast_exp(Gs[t] - Gs[s]) : 0.0f;
  });
  // over V: dP, dO S0^T and v dS^T in registers; S0 o dS's channel sums (thread: channel tid / 4,
  // a quarter of the slice's columns); the slice's dv
  tf32::Acc<C, C, NW> aP;
  tf32::Acc<C, K, NW> aQ, aK;
  aP.zero(), aQ.zero(), aK.zero();
  float sd = 0.0f;
  const int sc = tid >> 2, sq4 = tid & 3;
  for (int v0 = 0; v0 < p.V; v0 += VE) {
    if (v0 > 0) {
      __syncthreads();  // the slice before read
      load_slice(v0);
    }
    __syncthreads();  // (and A written)
    aP.add<VE, PREC>(rows(dOb, LV), cols(vb, LV));
    aQ.template add<VE, PREC>(rows(dOb, LV), cols(S0b, LV));
    aK.template add<VE, PREC>(rows(vb, LV), cols(dSb, LV));
    if (sc < K)
#pragma unroll 4
      for (int j = 16 * sq4; j < 16 * sq4 + 16; ++j) sd += S0b[sc * LV + j] * dSb[sc * LV + j];
    if (want_dv) {
      tf32::Acc<C, VE, NW> aV;
      aV.zero();
      aV.add<C, PREC>(cols(Am, LA), rows(dOb, LV));
      aV.template add<K, PREC>(RowScaled{ks, LK, eK}, rows(dSb, LV));
      const bwd::GradIO& io = bp.io;
      aV.drain([&](int s, int j, float v) {
        if (s < Lc) bwd::st(io.dv, io.dv_dt, ch.b_row * io.dv_s[0] + (ch.t0 + s) * io.dv_s[1] + hv * io.dv_s[2] + (v0 + j) * io.dv_s[3], v);
      });
    }
  }
  __syncthreads();  // the slices and A read
  float *dq = sm + Ly::dq, *dk = sm + Ly::dk, *dG = sm + Ly::dG;
  aQ.drain([&](int t, int c, float v) { dq[t * LK + c] = v; });
  aK.drain([&](int t, int c, float v) { dk[t * LK + c] = v; });
  aP.drain([&](int t, int s, float v) {
    if (s == t) dPd[t] = v;  // the diagonal, added at the write back
    Am[t * LA + s] = s < t ? v * fast_exp(Gs[t] - Gs[s]) : 0.0f;
  });
  __syncthreads();
  // the last token's term of dG per channel: S_end o dS summed over V = e^g (S0 o dS) + sum_s k^_s e^{g - G_s} (v dS^T)_s,
  // each term as dG's below takes it (so that one token's terms cancel exactly)
  if (sc < K) {
    float x = 0.0f;
#pragma unroll 4
    for (int s = 16 * sq4; s < 16 * sq4 + 16; ++s) x += ks[s * LK + sc] * (eK[s] * dk[s * LK + sc]);
    x += eg * sd;
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if (sq4 == 0) last[sc] = x;
  }
  __syncthreads();  // dk's state part read
  // dq^ = e^G (dO S0^T) + (dP o E) k^, dk^ = e^{g - G} (v dS^T) + (dP o E)^T q^: one shape, so the
  // thread that writes dG's element in the first owns it in the second
  tf32::gemm<C, K, C, NW, 2, PREC>(rows(Am, LA), rows(ks, LK), [&](int t, int c, float v) {
    const float x = eG[t] * dq[t * LK + c] + v;
    dq[t * LK + c] = x;
    dG[t * LK + c] = qs[t * LK + c] * x;
  });
  tf32::gemm<C, K, C, NW, 2, PREC>(cols(Am, LA), rows(qs, LK), [&](int s, int c, float v) {
    const float x = eK[s] * dk[s * LK + c] + v;
    dk[s * LK + c] = x;
    dG[s * LK + c] -= ks[s * LK + c] * x;
  });
  __syncthreads();
  float* const part = bp.part + (ch.f0 * p.HV + hv) * PW;  // token t's row: part + t row_ld
  const int64_t row_ld = static_cast<int64_t>(p.HV) * PW;
  for (int i = tid; i < Lc * K; i += NT) {  // the diagonal pairs' dq^ and dk^ terms, in fp32
    const int t = i / K, c = i % K;
    part[t * row_ld + c] = dq[t * LK + c] + dPd[t] * ks[t * LK + c];
    part[t * row_ld + K + c] = dk[t * LK + c] + dPd[t] * qs[t * LK + c];
  }
  if (!bp.want_da) return;
  // da_s = sum_{t >= s} dG_t, the last token's term in every sum: thread (channel, segment of SL tokens)
  constexpr int NSEG = NT / K, SL = C / NSEG;
  const int c = tid % K, sg = tid / K;
  float* segs = sm + Ly::seg;
  float v[SL], tot = 0.0f;
#pragma unroll
  for (int j = SL - 1; j >= 0; --j) {
    if (sg * SL + j < Lc) tot += dG[(sg * SL + j) * LK + c];
    v[j] = tot;
  }
  segs[sg * K + c] = tot;
  __syncthreads();
  float later = last[c];
  for (int q = NSEG - 1; q > sg; --q) later += segs[q * K + c];
#pragma unroll
  for (int j = 0; j < SL; ++j) {
    const int t = sg * SL + j;
    if (t < Lc) part[t * row_ld + 2 * K + c] = v[j] + later;
  }
}

// ---- 3, on bf16 operands ----------------------------------------------------------------------
// bf16 inputs whose gate is not activated in the kernel (the calls the general form gives one TF32
// product): every product on bf16 operands (bf16_gemm.cuh), the states bf16 from the scans, as FLA
// lays them out; the error model (tools/analysis/bwd_rounding.py --family) puts dq, dk and dv at
// 0.21-0.29x of FLA's tolerances there. The same steps as lean_grads_kernel, with: q^ and k^ as bf16
// tiles (converted from the prepared fp32 rows), A and then dP o E as a bf16 tile, the slices in two
// buffers (the next one's v, dO, S0 and dS copied in by cp.async while this one's products run), each
// product reading its operands as they lie (ldmatrix.trans for the transposed ones), and dv's state
// term scaled by e^{g - G} per row in registers. After the slices dq^, dk^ and dG (fp32) take the
// slice buffers. The diagonal pairs' dq^ / dk^ terms take the fp32 q^ and k^ at the write back.
template <int K>
struct LeanBfLayout {  // bytes
  static constexpr int LK = K + 8, LC = C + 8, LV = VE + 8, LF = K + 4;  // pitches (elements)
  static constexpr int q = 0, k = q + C * LK * 2, A = k + C * LK * 2, sl = A + C * LC * 2;
  // one slice buffer: v, dO (C x VE), S0, dS (K x VE)
  static constexpr int v = 0, dO = v + C * LV * 2, S0 = dO + C * LV * 2, dS = S0 + K * LV * 2, slice = dS + K * LV * 2;
  static constexpr int dq = sl, dk = dq + C * LF * 4, dG = dk + C * LF * 4;
  static_assert(dG + C * LF * 4 <= sl + 2 * slice, "dq^, dk^ and dG fit over the slice buffers");
  static constexpr int vec = sl + 2 * slice;  // floats: G, e^G, e^{g - G}, dP_tt (C each), the last token's terms (K), segments (NT)
  static constexpr int bytes = vec + (4 * C + K + NT) * 4;
};

// Rows [0, valid) of a ROWS x COLS fp32 matrix (16-byte aligned rows, pitch src_ld floats) into a bf16
// tile (pitch ld), rows past valid zeroed; every load issued before the first store.
template <int ROWS, int COLS>
__device__ __forceinline__ void f32_rows_to_bf16(__nv_bfloat16* dst, int ld, const float* src, int64_t src_ld, int valid) {
  constexpr int P = COLS / 8, PER = (ROWS * P + NT - 1) / NT;
  float4 x[PER][2];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * NT, r = i / P, c = (i % P) * 8;
    const bool in = i < ROWS * P && r < valid;
    x[u][0] = in ? *reinterpret_cast<const float4*>(src + r * src_ld + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    x[u][1] = in ? *reinterpret_cast<const float4*>(src + r * src_ld + c + 4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * NT, r = i / P, c = (i % P) * 8;
    if (i < ROWS * P)
      *reinterpret_cast<uint4*>(dst + r * ld + c) = make_uint4(mma::pack(x[u][0].x, x[u][0].y), mma::pack(x[u][0].z, x[u][0].w),
                                                               mma::pack(x[u][1].x, x[u][1].y), mma::pack(x[u][1].z, x[u][1].w));
  }
}

// Rows [0, valid) of a C x VE tile of a bf16, fp16 or fp32 input (unit column stride, 16-byte aligned
// rows, row r at element off + r row_stride) into a bf16 tile: bf16 by cp.async (the caller commits),
// the others converted through registers; rows past valid zeroed.
__device__ __forceinline__ void input_rows_to_bf16(__nv_bfloat16* dst, int ld, const void* src, int dt, int64_t off,
                                                   int64_t row_stride, int valid) {
  constexpr int P = VE / 8;
  for (int i = threadIdx.x; i < C * P; i += NT) {
    const int r = i / P, c = (i % P) * 8;
    __nv_bfloat16* d = dst + r * ld + c;
    const int64_t e = off + r * row_stride + c;
    if (r >= valid) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    } else if (dt == CULA_BFLOAT16) {
      mma::cp_async16(d, static_cast<const __nv_bfloat16*>(src) + e);
    } else {
      float f[8];
      if (dt == CULA_FLOAT32) {
        const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(src) + e),
                     b = *reinterpret_cast<const float4*>(static_cast<const float*>(src) + e + 4);
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
      } else {
        const uint4 w = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + e);
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const float2 h2 = mma::unpack<__half>(ws[m]);
          f[2 * m] = h2.x, f[2 * m + 1] = h2.y;
        }
      }
      *reinterpret_cast<uint4*>(d) = make_uint4(mma::pack(f[0], f[1]), mma::pack(f[2], f[3]), mma::pack(f[4], f[5]), mma::pack(f[6], f[7]));
    }
  }
}

// Rows [0, valid) of a C x COLS bf16 matrix (16-byte aligned rows, row r at src + r row_stride) times
// s into a bf16 tile (pitch ld), rows past valid zeroed; every load issued before the first store.
template <int COLS>
__device__ __forceinline__ void bf16_rows_scaled(__nv_bfloat16* dst, int ld, const __nv_bfloat16* src, int64_t row_stride,
                                                 int valid, float s) {
  constexpr int P = COLS / 8, PER = (C * P + NT - 1) / NT;
  uint4 x[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * NT, r = i / P, c = (i % P) * 8;
    x[u] = i < C * P && r < valid ? *reinterpret_cast<const uint4*>(src + r * row_stride + c) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = threadIdx.x + u * NT, r = i / P, c = (i % P) * 8;
    if (i >= C * P) break;
    const uint32_t w[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
    uint32_t o[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float2 f = mma::unpack(w[m]);
      o[m] = mma::pack(s * f.x, s * f.y);
    }
    *reinterpret_cast<uint4*>(dst + r * ld + c) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// DIRECT: the direct path (q and k read as they lie, q^ = scale q; the gate from the inputs; dq, dk
// and dg written here, no part rows).
template <int K, bool DIRECT>
__global__ void __launch_bounds__(NT, 1) lean_grads_bf16_kernel(const LeanParams bp) {
  using Ly = LeanBfLayout<K>;
  using bf = __nv_bfloat16;
  using bf16mm::kmajor;
  using bf16mm::mnmajor;
  constexpr int LK = Ly::LK, LC = Ly::LC, LV = Ly::LV, LF = Ly::LF;
  constexpr int64_t PW = bwd::part_width(K);
  extern __shared__ __align__(128) unsigned char smb[];
  bf *qb = reinterpret_cast<bf*>(smb + Ly::q), *kb = reinterpret_cast<bf*>(smb + Ly::k), *Ab = reinterpret_cast<bf*>(smb + Ly::A);
  float* const vec = reinterpret_cast<float*>(smb + Ly::vec);
  float *Gs = vec, *eG = vec + C, *eK = vec + 2 * C, *dPd = vec + 3 * C, *last = vec + 4 * C, *segs = last + K;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int cidx = static_cast<int>(blockIdx.x / p.HV), hv = static_cast<int>(blockIdx.x % p.HV);
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!bwd::chunk_at(p, bp.chunk_base, cidx, ch)) return;
  const int Lc = ch.Lc, nsl = p.V / VE;
  const int64_t qk_ld = static_cast<int64_t>(p.H) * K, st_off = (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V;
  const float *qg = bp.x.qh + (ch.f0 * p.H + h) * K, *kg = bp.x.kh + (ch.f0 * p.H + h) * K;  // (prepared)
  const bf *qr = static_cast<const bf*>(p.q) + ch.b_row * p.q_s[0] + ch.t0 * p.q_s[1] + h * p.q_s[2],  // (direct)
           *kr = static_cast<const bf*>(p.k) + ch.b_row * p.k_s[0] + ch.t0 * p.k_s[1] + h * p.k_s[2];
  const bool want_dv = bp.io.dv != nullptr;

  auto slice_at = [&](int i) { return smb + Ly::sl + (i & 1) * Ly::slice; };
  auto load_slice = [&](int i) {
    unsigned char* b = slice_at(i);
    const int v0 = i * VE;
    const bf *S0g = static_cast<const bf*>(bp.S0) + st_off + v0, *dSg = static_cast<const bf*>(bp.dS) + st_off + v0;
    for (int x = tid; x < K * (VE / 8); x += NT) {
      const int r = x / (VE / 8), c = (x % (VE / 8)) * 8;
      mma::cp_async16(b + Ly::S0 + (r * LV + c) * 2, S0g + r * static_cast<int64_t>(p.V) + c);
      mma::cp_async16(b + Ly::dS + (r * LV + c) * 2, dSg + r * static_cast<int64_t>(p.V) + c);
    }
    input_rows_to_bf16(reinterpret_cast<bf*>(b + Ly::v), LV, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0,
                       p.v_s[1], Lc);
    input_rows_to_bf16(reinterpret_cast<bf*>(b + Ly::dO), LV, bp.io.dO, bp.io.dO_dt,
                       ch.b_row * bp.io.dO_s[0] + ch.t0 * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0, bp.io.dO_s[1], Lc);
    mma::cp_async_commit();
  };
  if (warp == 0) {
    float a0, a1;
    if constexpr (DIRECT) {
      a0 = lane < Lc ? input_log_decay(p, ch.b_row, ch.t0 + lane, hv) : 0.0f;
      a1 = lane + 32 < Lc ? input_log_decay(p, ch.b_row, ch.t0 + lane + 32, hv) : 0.0f;
    } else {
      a0 = lane < Lc ? *decay_row(bp, ch.f0 + lane, hv) : 0.0f;
      a1 = lane + 32 < Lc ? *decay_row(bp, ch.f0 + lane + 32, hv) : 0.0f;
    }
    const float g = chunk_decays(a0, a1, lane, Lc, Gs, eG, eK);
    if (lane == 0) last[0] = g;  // (read into a register below, before last is written)
  }
  if constexpr (DIRECT) {
    bf16_rows_async<K, NT>(kb, LK, kr, p.k_s[1], Lc);
    mma::cp_async_commit();  // (a group of its own, before the slices')
  }
  load_slice(0);
  if (nsl > 1) load_slice(1);
  if constexpr (DIRECT) {
    bf16_rows_scaled<K>(qb, LK, qr, p.q_s[1], Lc, p.scale);
    mma::cp_async_wait_pending(nsl > 1 ? 2 : 1);  // k's rows in
  } else {
    f32_rows_to_bf16<C, K>(qb, LK, qg, qk_ld, Lc);
    f32_rows_to_bf16<C, K>(kb, LK, kg, qk_ld, Lc);
  }
  __syncthreads();
  const float eg = fast_exp(last[0]);
  {  // A = (q^ k^T) o E, the diagonal included
    bf16mm::Acc<C, C, NW> a;
    a.zero();
    a.template add<K>(kmajor(qb, LK), kmajor(kb, LK));
    a.drain([&](int t, int s, float x0, float x1) {
      const float e0 = s <= t ? fast_exp(Gs[t] - Gs[s]) : 0.0f, e1 = s + 1 <= t ? fast_exp(Gs[t] - Gs[s + 1]) : 0.0f;
      *reinterpret_cast<uint32_t*>(Ab + t * LC + s) = mma::pack(x0 * e0, x1 * e1);
    });
  }
  bf16mm::Acc<C, C, NW> aP;
  bf16mm::Acc<C, K, NW> aQ, aK;
  aP.zero(), aQ.zero(), aK.zero();
  float sd = 0.0f;  // S0 o dS over V for channel tid / 4, a quarter of each slice's columns
  const int sc = tid >> 2, sq4 = tid & 3;
  for (int i = 0; i < nsl; ++i) {
    mma::cp_async_wait_pending(i + 1 < nsl ? 1 : 0);
    __syncthreads();  // slice i in (and A written)
    const unsigned char* b = slice_at(i);
    const bf *vb = reinterpret_cast<const bf*>(b + Ly::v), *dOb = reinterpret_cast<const bf*>(b + Ly::dO),
             *S0b = reinterpret_cast<const bf*>(b + Ly::S0), *dSb = reinterpret_cast<const bf*>(b + Ly::dS);
    aP.template add<VE>(kmajor(dOb, LV), kmajor(vb, LV));   // dP_ts = dO_t . v_s
    aQ.template add<VE>(kmajor(dOb, LV), kmajor(S0b, LV));  // (dO S0^T)_tc
    aK.template add<VE>(kmajor(vb, LV), kmajor(dSb, LV));   // (v dS^T)_sc
    if (sc < K) {
      const __nv_bfloat162 *x = reinterpret_cast<const __nv_bfloat162*>(S0b + sc * LV + 16 * sq4),
                           *y = reinterpret_cast<const __nv_bfloat162*>(dSb + sc * LV + 16 * sq4);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 a = __bfloat1622float2(x[j]), c = __bfloat1622float2(y[j]);
        sd += a.x * c.x + a.y * c.y;
      }
    }
    if (want_dv) {  // dv = A^T dO + diag(e^{g - G}) (k^ dS)
      bf16mm::Acc<C, VE, NW> dA, dK;
      dA.zero(), dK.zero();
      dA.template add<C>(mnmajor(Ab, LC), mnmajor(dOb, LV));
      dK.template add<K>(kmajor(kb, LK), mnmajor(dSb, LV));
      dA.add_rows_scaled(dK, eK);
      const bwd::GradIO& io = bp.io;
      const int v0 = i * VE;
      const bool pairs = io.dv_dt == CULA_BFLOAT16 && io.dv_s[3] == 1 && io.dv_s[1] % 2 == 0 && io.dv_s[0] % 2 == 0 &&
                         io.dv_s[2] % 2 == 0 && (reinterpret_cast<uintptr_t>(io.dv) & 3) == 0;
      dA.drain([&](int s, int j, float x0, float x1) {
        if (s >= Lc) return;
        const int64_t o = ch.b_row * io.dv_s[0] + (ch.t0 + s) * io.dv_s[1] + hv * io.dv_s[2] + (v0 + j) * io.dv_s[3];
        if (pairs) {
          *reinterpret_cast<uint32_t*>(static_cast<bf*>(io.dv) + o) = mma::pack(x0, x1);
        } else {
          bwd::st(io.dv, io.dv_dt, o, x0);
          bwd::st(io.dv, io.dv_dt, o + io.dv_s[3], x1);
        }
      });
    }
    __syncthreads();  // slice i read
    if (i + 2 < nsl) load_slice(i + 2);
  }
  float *dq = reinterpret_cast<float*>(smb + Ly::dq), *dk = reinterpret_cast<float*>(smb + Ly::dk),
        *dG = reinterpret_cast<float*>(smb + Ly::dG);
  aQ.drain([&](int t, int c, float x0, float x1) { *reinterpret_cast<float2*>(dq + t * LF + c) = make_float2(x0, x1); });
  aK.drain([&](int t, int c, float x0, float x1) { *reinterpret_cast<float2*>(dk + t * LF + c) = make_float2(x0, x1); });
  aP.drain([&](int t, int s, float x0, float x1) {
    if (s == t) dPd[t] = x0;  // the diagonal, added at the write back
    if (s + 1 == t) dPd[t] = x1;
    const float e0 = s < t ? fast_exp(Gs[t] - Gs[s]) : 0.0f, e1 = s + 1 < t ? fast_exp(Gs[t] - Gs[s + 1]) : 0.0f;
    *reinterpret_cast<uint32_t*>(Ab + t * LC + s) = mma::pack(x0 * e0, x1 * e1);
  });
  __syncthreads();
  // the last token's term of dG per channel: e^g (S0 o dS) + sum_s k^_s (e^{g - G_s} (v dS^T)_s), with
  // k^ as dG's terms take it below (so that one token's terms cancel exactly)
  if (sc < K) {
    float x = 0.0f;
#pragma unroll 4
    for (int s = 16 * sq4; s < 16 * sq4 + 16; ++s) x += __bfloat162float(kb[s * LK + sc]) * (eK[s] * dk[s * LF + sc]);
    x += eg * sd;
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    if (sq4 == 0) last[sc] = x;
  }
  __syncthreads();  // dk's state part read
  {  // dq^ = e^G (dO S0^T) + (dP o E) k^
    bf16mm::Acc<C, K, NW> x;
    x.zero();
    x.template add<C>(kmajor(Ab, LC), mnmajor(kb, LK));
    x.drain([&](int t, int c, float x0, float x1) {
      float2* d = reinterpret_cast<float2*>(dq + t * LF + c);
      const float2 o = *d;
      *d = make_float2(eG[t] * o.x + x0, eG[t] * o.y + x1);
    });
  }
  {  // dk^ = e^{g - G} (v dS^T) + (dP o E)^T q^, and dG = q^ o dq^ - k^ o dk^ (one shape: the thread has dq^'s element)
    bf16mm::Acc<C, K, NW> x;
    x.zero();
    x.template add<C>(mnmajor(Ab, LC), mnmajor(qb, LK));
    x.drain([&](int s, int c, float x0, float x1) {
      float2* d = reinterpret_cast<float2*>(dk + s * LF + c);
      const float2 o = *d, q2 = *reinterpret_cast<const float2*>(dq + s * LF + c);
      const float d0 = eK[s] * o.x + x0, d1 = eK[s] * o.y + x1;
      *d = make_float2(d0, d1);
      const float2 qq = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qb + s * LK + c)),
                   kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kb + s * LK + c));
      *reinterpret_cast<float2*>(dG + s * LF + c) = make_float2(qq.x * q2.x - kk.x * d0, qq.y * q2.y - kk.y * d1);
    });
  }
  __syncthreads();
  float* const part = bp.part + (ch.f0 * p.HV + hv) * PW;  // token t's row: part + t row_ld
  const int64_t row_ld = static_cast<int64_t>(p.HV) * PW;
  if constexpr (DIRECT) {  // dq = scale dq^, dk = dk^ (no L2 norm, one value head per q/k head); two channels a thread
    const bool q2 = bp.dq_dt == CULA_BFLOAT16 && (reinterpret_cast<uintptr_t>(bp.dq) & 3) == 0,
               k2 = bp.dk_dt == CULA_BFLOAT16 && (reinterpret_cast<uintptr_t>(bp.dk) & 3) == 0;
    for (int i = tid; i < Lc * (K / 2); i += NT) {
      const int t = i / (K / 2), c = 2 * (i % (K / 2));
      const float2 kv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kr + t * p.k_s[1] + c)),
                   qv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(qr + t * p.q_s[1] + c));
      const int64_t o = ((ch.f0 + t) * p.H + h) * static_cast<int64_t>(K) + c;
      const float2 x = *reinterpret_cast<const float2*>(dq + t * LF + c), y = *reinterpret_cast<const float2*>(dk + t * LF + c);
      const float q0 = p.scale * (x.x + dPd[t] * kv.x), q1 = p.scale * (x.y + dPd[t] * kv.y);
      const float k0 = y.x + dPd[t] * (p.scale * qv.x), k1 = y.y + dPd[t] * (p.scale * qv.y);
      if (bp.dq) {
        if (q2) *reinterpret_cast<uint32_t*>(static_cast<bf*>(bp.dq) + o) = mma::pack(q0, q1);
        else bwd::st(bp.dq, bp.dq_dt, o, q0), bwd::st(bp.dq, bp.dq_dt, o + 1, q1);
      }
      if (bp.dk) {
        if (k2) *reinterpret_cast<uint32_t*>(static_cast<bf*>(bp.dk) + o) = mma::pack(k0, k1);
        else bwd::st(bp.dk, bp.dk_dt, o, k0), bwd::st(bp.dk, bp.dk_dt, o + 1, k1);
      }
    }
  } else {
    for (int i = tid; i < Lc * K; i += NT) {  // the diagonal pairs' dq^ and dk^ terms, in fp32
      const int t = i / K, c = i % K;
      part[t * row_ld + c] = dq[t * LF + c] + dPd[t] * kg[t * qk_ld + c];
      part[t * row_ld + K + c] = dk[t * LF + c] + dPd[t] * qg[t * qk_ld + c];
    }
  }
  if (!bp.want_da) return;
  // da_s = sum_{t >= s} dG_t, the last token's term in every sum: thread (channel, segment of SL tokens)
  constexpr int NSEG = NT / K, SL = C / NSEG;
  const int c = tid % K, sg = tid / K;
  float v[SL], tot = 0.0f;
#pragma unroll
  for (int j = SL - 1; j >= 0; --j) {
    if (sg * SL + j < Lc) tot += dG[(sg * SL + j) * LF + c];
    v[j] = tot;
  }
  segs[sg * K + c] = tot;
  __syncthreads();
  float later = last[c];
  for (int q = NSEG - 1; q > sg; --q) later += segs[q * K + c];
#pragma unroll
  for (int j = 0; j < SL; ++j) {
    const int t = sg * SL + j;
    if (!DIRECT && t < Lc) part[t * row_ld + 2 * K + c] = v[j] + later;
    if (DIRECT) dG[t * LF + c] = v[j] + later;  // (each thread its own elements, read above)
  }
  if constexpr (DIRECT) {  // the scalar gate's gradient: da summed over the channels, a warp per token
    __syncthreads();
    for (int t = warp; t < Lc; t += NW) {
      float x = 0.0f;
      for (int cc = lane; cc < K; cc += 32) x += dG[t * LF + cc];
      x = dev::warp_sum(x);
      if (lane == 0 && bp.dg) bwd::st(bp.dg, bp.dg_dt, (ch.f0 + t) * p.HV + hv, x);
    }
  }
}

// ---- host --------------------------------------------------------------------------------------
template <class F>
auto with_lean_key_size(int K, F&& f) {
  if (K == 64) return f(std::integral_constant<int, 64>{});
  return f(std::integral_constant<int, 128>{});
}

int lean_smem(int K, int width, int dt) {
  return with_lean_key_size(K, [&](auto k) {
    constexpr int KK = decltype(k)::value;
    const int scans = width == 32 ? LeanScanLayout<KK, 32>::bytes(dt) : LeanScanLayout<KK, 16>::bytes(dt);
    return scans > LeanGradsLayout<KK>::bytes ? scans : LeanGradsLayout<KK>::bytes;
  });
}

// BF16: the bf16 path (states and the gradient kernel's operands bf16; the scans' products one TF32
// product); otherwise fp32 states and PREC throughout.
template <int K, int PREC, bool BF16>
void run_lean(const LeanParams& bp, int64_t chunks, int N, int HV, int V, int width, int dt, cudaStream_t stream) {
  auto scans = [&](auto w) {
    constexpr int W = decltype(w)::value;
    const int64_t grid = 2 * static_cast<int64_t>(N) * HV * (V / W);
    if (grid <= 0) return;
    const int bytes = LeanScanLayout<K, W>::bytes(dt);
    chunk::allow_smem(lean_scans_kernel<K, W, PREC, BF16>, bytes);
    lean_scans_kernel<K, W, PREC, BF16><<<static_cast<unsigned>(grid), ST, bytes, stream>>>(bp);
  };
  if (width == 32) scans(std::integral_constant<int, 32>{});
  else scans(std::integral_constant<int, 16>{});
  if (chunks * HV <= 0) return;
  const unsigned grid = static_cast<unsigned>(chunks * HV);
  if constexpr (BF16) {
    chunk::allow_smem(lean_grads_bf16_kernel<K, false>, LeanBfLayout<K>::bytes);
    lean_grads_bf16_kernel<K, false><<<grid, NT, LeanBfLayout<K>::bytes, stream>>>(bp);
  } else {
    chunk::allow_smem(lean_grads_kernel<K, PREC>, LeanGradsLayout<K>::bytes);
    lean_grads_kernel<K, PREC><<<grid, NT, LeanGradsLayout<K>::bytes, stream>>>(bp);
  }
}

// The direct path: the direct scans (K = 64 at 32 columns, where 16 would leave warps without tiles)
// and the bf16 gradient kernel writing dq, dk and dg itself.
template <int K>
void run_lean_direct(const LeanParams& bp, int64_t chunks, int N, int HV, int V, int width, cudaStream_t stream) {
  auto scans = [&](auto w) {
    constexpr int W = decltype(w)::value;
    const int64_t grid = 2 * static_cast<int64_t>(N) * HV * (V / W);
    if (grid <= 0) return;
    chunk::allow_smem(lean_direct_scans_kernel<K, W>, LeanDirectScanLayout<K, W>::bytes);
    lean_direct_scans_kernel<K, W><<<static_cast<unsigned>(grid), ST, LeanDirectScanLayout<K, W>::bytes, stream>>>(bp);
  };
  if constexpr (K == 64) {
    scans(std::integral_constant<int, 32>{});
  } else {
    if (width == 32) scans(std::integral_constant<int, 32>{});
    else scans(std::integral_constant<int, 16>{});
  }
  if (chunks * HV <= 0) return;
  chunk::allow_smem(lean_grads_bf16_kernel<K, true>, LeanBfLayout<K>::bytes);
  lean_grads_bf16_kernel<K, true><<<static_cast<unsigned>(chunks * HV), NT, LeanBfLayout<K>::bytes, stream>>>(bp);
}

// The call's path (lean_plan.h).
bwd::LeanPath lean_path_of(const Recurrence& r, const cula_chunk_bwd_args& a) {
  bwd::LeanCall c{};
  c.gate_in_kernel = r.gate_in_kernel, c.l2norm = r.l2norm, c.grouped = r.H != r.HV;
  c.param_grads = a.dbeta || a.dA_log || a.ddt_bias;
  c.qk_rows16 = chunk::aligned16(a.q) && chunk::aligned16(a.k);
  c.q_dt = a.q->dtype, c.k_dt = a.k->dtype, c.v_dt = a.v->dtype, c.d_out_dt = a.d_out->dtype;
  return bwd::lean_path(c);
}

// The scans read v and d_out in their own dtypes: the wider of the two sizes their raw buffers.
int raw_dtype(const cula_chunk_bwd_args& a) {
  return a.v->dtype == CULA_FLOAT32 || a.d_out->dtype == CULA_FLOAT32 ? CULA_FLOAT32 : CULA_BFLOAT16;
}

int plan_width(const Recurrence& r, int device) {
  return bwd::scan_width(false, static_cast<int>(r.K), r.N, r.HV, r.V, cuda_sm_count(device), cuda_device_arch(device) == 90);
}

}  // namespace

bool lean_form(const Recurrence& r, int device) {
  if (r.tr.delta || r.tr.gate == GateKind::PerChannel || r.K > 128 || r.V % VE != 0) return false;
  if (const char* e = std::getenv("CULA_BWD_LEAN"))
    if (std::strcmp(e, "0") == 0) return false;
  // (the widest raw rows: float32)
  return lean_smem(static_cast<int>(r.K), plan_width(r, device), CULA_FLOAT32) <= cuda_smem_per_block(device);
}

void cuda_lean_bwd(const Recurrence& r, const cula_chunk_bwd_args& a) {
  const char* op = "chunk_bwd";
  const int device = a.q->device_id;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const int64_t BT = r.B * r.T, K = r.K, V = r.V, HV = r.HV;
  using bwd::align256;

  LeanParams bp{};
  bp.f = make_fwd_params(r, bwd::forward_args(a));
  const int64_t chunks = chunk::max_chunks(bp.f);
  if (chunks * HV >= (int64_t{1} << 31) / 2) throw_unsupported(op, "too many chunks x heads for one launch");
  const bwd::LeanPath path = lean_path_of(r, a);  // (lean_plan.h)
  const bool precise = path == bwd::LeanPath::Precise, direct = path == bwd::LeanPath::Direct;
  const int64_t state_bytes = align256(chunks * HV * K * V * (precise ? 4 : 2));
  const int64_t sizes[] = {
      chunk::base_bytes(bp.f),                                 // chunk_base
      direct ? 0 : bwd::token_inputs_bytes(r),                 // q^, k^, a, beta
      state_bytes,                                             // S0
      state_bytes,                                             // dS
      direct ? 0 : align256(BT * HV * bwd::part_width(K) * 4),  // part
      direct ? 0 : bwd::chain_bytes(r),                        // chain
  };
  chunk::Workspace ws(bwd::total_bytes(sizes), device, stream, op);
  char* at[sizeof(sizes) / sizeof(sizes[0])];
  bwd::carve(ws.get(), sizes, at);
  bp.chunk_base = a.cu_seqlens ? reinterpret_cast<int32_t*>(at[0]) : nullptr;
  if (!direct) bp.x = bwd::token_inputs_at(at[1], r);
  bp.S0 = at[2];
  bp.dS = at[3];
  bp.part = reinterpret_cast<float*>(at[4]);
  bp.io = bwd::grad_io(a);
  bp.want_da = r.tr.gate != GateKind::Constant && (a.dg != nullptr || r.gate_in_kernel);
  if (a.dq) bp.dq = a.dq->data, bp.dq_dt = a.dq->dtype;
  if (a.dk) bp.dk = a.dk->data, bp.dk_dt = a.dk->dtype;
  if (a.dg) bp.dg = a.dg->data, bp.dg_dt = a.dg->dtype;

  if (bp.chunk_base) chunk::launch_chunk_base(bp.f, bp.chunk_base, stream);
  if (!direct) bwd::launch_token_inputs(bp.f, bp.x, /*log_decay=*/true, stream);
  const int width = plan_width(r, device), dt = raw_dtype(a);
  with_lean_key_size(static_cast<int>(K), [&](auto k) {
    constexpr int KK = decltype(k)::value;
    const int n = static_cast<int>(r.N), hv = static_cast<int>(HV), v = static_cast<int>(V);
    if (direct) run_lean_direct<KK>(bp, chunks, n, hv, v, width, stream);
    else if (precise) run_lean<KK, tf32::kThreeTF32, false>(bp, chunks, n, hv, v, width, dt, stream);
    else run_lean<KK, tf32::kOneTF32, true>(bp, chunks, n, hv, v, width, dt, stream);
  });
  bwd::check(cudaGetLastError(), "kernel launch");
  if (!direct) bwd::launch_chain(r, a, bp.f, bp.part, /*tiles=*/1, at[5], stream);
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  bwd::check(launched, "kernel launch");
}

}  // namespace cula
