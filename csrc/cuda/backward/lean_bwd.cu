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
};

inline int elem_bytes(int dt) { return dt == CULA_FLOAT32 ? 4 : 2; }

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

// A token's log-decay (one per token: channel 0 of the repeated row).
__device__ __forceinline__ const float* decay_row(const LeanParams& bp, int64_t f, int hv) {
  return bp.x.dec + (f * bp.f.HV + hv) * static_cast<int64_t>(bp.f.K);
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
  const int dt = GRAD ? bp.io.dO_dt : p.v_dt, es = dt == CULA_FLOAT32 ? 4 : 2;
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
  float g = 0.0f;  // (warp 0's)
  if (warp == 0) {
    const float a0 = lane < Lc ? *decay_row(bp, ch.f0 + lane, hv) : 0.0f;
    const float a1 = lane + 32 < Lc ? *decay_row(bp, ch.f0 + lane + 32, hv) : 0.0f;
    float G0, G1;
    g = chunk_cumsum(a0, a1, lane, G0, G1);
    Gs[lane] = G0, Gs[lane + 32] = G1;
    eG[lane] = lane < Lc ? fast_exp(G0) : 0.0f;
    eG[lane + 32] = lane + 32 < Lc ? fast_exp(G1) : 0.0f;
    eK[lane] = lane < Lc ? fast_exp(g - G0) : 0.0f;
    eK[lane + 32] = lane + 32 < Lc ? fast_exp(g - G1) : 0.0f;
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

template <int K>
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
  const float *qg = bp.x.qh + (ch.f0 * p.H + h) * K, *kg = bp.x.kh + (ch.f0 * p.H + h) * K;
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
    const float a0 = lane < Lc ? *decay_row(bp, ch.f0 + lane, hv) : 0.0f;
    const float a1 = lane + 32 < Lc ? *decay_row(bp, ch.f0 + lane + 32, hv) : 0.0f;
    float G0, G1;
    const float g = chunk_cumsum(a0, a1, lane, G0, G1);
    Gs[lane] = G0, Gs[lane + 32] = G1;
    eG[lane] = lane < Lc ? fast_exp(G0) : 0.0f;
    eG[lane + 32] = lane + 32 < Lc ? fast_exp(G1) : 0.0f;
    eK[lane] = lane < Lc ? fast_exp(g - G0) : 0.0f;
    eK[lane + 32] = lane + 32 < Lc ? fast_exp(g - G1) : 0.0f;
    if (lane == 0) last[0] = g;  // (read into a register below, before last is written)
  }
  load_slice(0);
  if (nsl > 1) load_slice(1);
  f32_rows_to_bf16<C, K>(qb, LK, qg, qk_ld, Lc);
  f32_rows_to_bf16<C, K>(kb, LK, kg, qk_ld, Lc);
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
      dA.drain([&](int s, int j, float x0, float x1) {
        if (s >= Lc) return;
        const int64_t o = ch.b_row * io.dv_s[0] + (ch.t0 + s) * io.dv_s[1] + hv * io.dv_s[2] + (v0 + j) * io.dv_s[3];
        bwd::st(io.dv, io.dv_dt, o, x0);
        bwd::st(io.dv, io.dv_dt, o + io.dv_s[3], x1);
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
  for (int i = tid; i < Lc * K; i += NT) {  // the diagonal pairs' dq^ and dk^ terms, in fp32
    const int t = i / K, c = i % K;
    part[t * row_ld + c] = dq[t * LF + c] + dPd[t] * kg[t * qk_ld + c];
    part[t * row_ld + K + c] = dk[t * LF + c] + dPd[t] * qg[t * qk_ld + c];
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
    if (t < Lc) part[t * row_ld + 2 * K + c] = v[j] + later;
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
    chunk::allow_smem(lean_grads_bf16_kernel<K>, LeanBfLayout<K>::bytes);
    lean_grads_bf16_kernel<K><<<grid, NT, LeanBfLayout<K>::bytes, stream>>>(bp);
  } else {
    chunk::allow_smem(lean_grads_kernel<K, PREC>, LeanGradsLayout<K>::bytes);
    lean_grads_kernel<K, PREC><<<grid, NT, LeanGradsLayout<K>::bytes, stream>>>(bp);
  }
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
  // the products' precision as the general form's (chunk_bwd.cu): three TF32 products where the gate
  // is activated in the kernel or the inputs are not bf16; otherwise the bf16 path
  const bool precise = r.gate_in_kernel || a.q->dtype != CULA_BFLOAT16 || a.k->dtype != CULA_BFLOAT16 ||
                       a.v->dtype != CULA_BFLOAT16;
  const int64_t state_bytes = align256(chunks * HV * K * V * (precise ? 4 : 2));
  const int64_t sizes[] = {
      chunk::base_bytes(bp.f),                     // chunk_base
      bwd::token_inputs_bytes(r),                  // q^, k^, a, beta
      state_bytes,                                 // S0
      state_bytes,                                 // dS
      align256(BT * HV * bwd::part_width(K) * 4),  // part
      bwd::chain_bytes(r),                         // chain
  };
  constexpr int kParts = sizeof(sizes) / sizeof(sizes[0]);
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  chunk::Workspace ws(total, device, stream, op);
  char* at[kParts];
  {
    char* w = static_cast<char*>(ws.get());
    for (int i = 0; i < kParts; ++i) at[i] = w, w += sizes[i];
  }
  bp.chunk_base = a.cu_seqlens ? reinterpret_cast<int32_t*>(at[0]) : nullptr;
  bp.x = bwd::token_inputs_at(at[1], r);
  bp.S0 = reinterpret_cast<float*>(at[2]);
  bp.dS = reinterpret_cast<float*>(at[3]);
  bp.part = reinterpret_cast<float*>(at[4]);
  bp.io = bwd::grad_io(a);
  bp.want_da = r.tr.gate != GateKind::Constant && (a.dg != nullptr || r.gate_in_kernel);

  if (bp.chunk_base) chunk::launch_chunk_base(bp.f, bp.chunk_base, stream);
  bwd::launch_token_inputs(bp.f, bp.x, /*log_decay=*/true, stream);
  const int width = plan_width(r, device), dt = raw_dtype(a);
  with_lean_key_size(static_cast<int>(K), [&](auto k) {
    constexpr int KK = decltype(k)::value;
    const int n = static_cast<int>(r.N), hv = static_cast<int>(HV), v = static_cast<int>(V);
    if (precise) run_lean<KK, tf32::kThreeTF32, false>(bp, chunks, n, hv, v, width, dt, stream);
    else run_lean<KK, tf32::kOneTF32, true>(bp, chunks, n, hv, v, width, dt, stream);
  });
  bwd::check(cudaGetLastError(), "kernel launch");
  bwd::launch_chain(r, a, bp.f, bp.part, /*tiles=*/1, at[5], stream);
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  bwd::check(launched, "kernel launch");
}

}  // namespace cula
