// Backward in chunk form on tensor cores (3xTF32 mma.sync, fp32 operands in shared memory; on sm_90a
// the key kernel with the delta rule, the value kernel, the pair kernel's products over V with the
// delta rule (and GDN's pair products), and, at K <= 128, the scan inputs kernel and
// the delta rule's state scans on warpgroups with bf16x3 operands, split once as they are staged):
// every family and option, key head sizes 64, 128 and 256, V a multiple of 64. The algebra is DESIGN.md's
// (checked in float64 by tests/python/test_chunked_backward_algebra.py); chunks of C = 64 tokens, G
// the inclusive cumulative log-decay inside a chunk, per channel (a scalar or constant gate repeated
// over K), every exponent e^{G_t - G_s} with s <= t (or through a token between them), so no factor
// exceeds 1 for any decay.
//
// Kernels, in stream order (one workspace, chunk::Workspace):
//  1. prepare_tokens_kernel (chain.cu): q^, k^, the log-decay a and beta per token.
//  2. chunk_factors_kernel, one CTA per (chunk, value head): G; the pair matrices
//     P = tril(q^ E k^T) and KEK = stril(k^ E k^T) (per-channel decay: diagonal 16 x 16 blocks
//     exact, a warp per two rows of two blocks, the blocks below on tensor cores through the last token before
//     the row block; a scalar or constant decay: E_ts a number per pair, so (q^ k^T) o E whole on
//     tensor cores); channels in slices of 128 (K = 256: two);
//     T = (I + diag(beta) KEK)^-1 by 16-row blocks; W = T diag(beta) Kg; Qg, Kr, e^{G_C}.
//  3. scan_inputs_kernel, per (chunk, value head, 64 columns): what the scans add without carrying
//     it, U = T (beta v) (U = v without the delta rule), X = P^T dO and Y = Qg^T dO.
//  4. state_scans_kernel, two roles on alternate CTAs of one launch (they do not depend on each
//     other), per (sequence, value head, VS columns), two CTAs per SM: chunks in order, the state
//     at every chunk start S0 (fp32): Delta = U - W S, S <- e^{G_C} S + Kr^T Delta; and chunks
//     last to first, the gradient dS of each chunk's end state: dDelta = X + Kr dS,
//     dS <- e^{G_C} dS + Y - W^T dDelta. Without the delta rule dDelta is dv. On sm_90a with the
//     delta rule at K <= 128: 32 or 64 columns a CTA, the carried matrix in registers (scan_wg).
//  5. value_grad_kernel (delta rule), per (chunk, value head, 64 columns): R = v - Kg S0,
//     Delta = T diag(beta) R, dB = T^T dDelta; dv = beta dB, beta's partial sum dB . R.
//  6. key_grad_kernel, per (chunk, value head, 64 channels): over V, dQg = dO S0^T,
//     dKg = -(beta dB) S0^T, dKr = Delta dS^T and the channel sums of S0 . dS; their terms of
//     dq^, dk^ and dG.
//  7. pair_grad_kernel, per (chunk, value head): dP = tril(dO Delta^T), dA = -stril(dB Delta^T)
//     over V, once; beta's KEK term; then by halves of 64 channels, the pair terms of dq^, dk^ and
//     dG, accumulated in shared memory on top of the key kernel's and written back once (per-channel
//     decay: diagonal blocks exact per channel, the rest on tensor cores; a scalar decay: dP o E and
//     w o E whole on tensor cores, three products); da, the reverse cumulative sum of dG.
//  8. the chain kernels (chain.cu), as the recurrent form.
// The scans stream the next chunk's tiles by cp.async one phase ahead. Deterministic: every
// sum in a fixed order, no atomics. Barriers: __syncthreads between phases; an accumulating product
// hands each element to the thread that stored it (tf32_gemm.cuh).
#include "cuda/backward/chunk_bwd.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "cuda/backward/chain.h"
#include "cuda/backward/chunk_tiles.cuh"
#include "cuda/backward/lean_bwd.h"
#include "cuda/backward/recurrent_bwd.h"
#include "cuda/backward/scan_width.h"
#include "cuda/common/fwd_params.cuh"
#include "cuda/kerutils/device_utils.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/kerutils/tf32_gemm.cuh"
#include "cuda/kerutils/wgmma.cuh"
#include "cuda/prefill/chunk_common.cuh"
#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace {

using bwd::ChunkAt;
using bwd::chunk_in;
using bwd::fast_exp;
using bwd::input_rows;
using bwd::RowScaled;
using bwd::rows_async;
using bwd::slice_in;
using bwd::slice_out;
using dev::ld;
using dev::st;
using tf32::cols;
using tf32::rows;

constexpr int C = kChunk;  // 64 tokens
constexpr int NW = 16, NT = 32 * NW;
static_assert(NT == bwd::kTileThreads, "the tile loads' default block");
constexpr int VE = 64;  // columns (or channels) per CTA or pass of the per-chunk kernels

// One factor block per (chunk, value head), fp32, in this order: P, T, KEK (C x C), W, Qg, Kr, G
// (C x K, row per token), e^{G_C} (K).
template <int K>
struct Fac {
  static constexpr int P = 0, T = C * C, KEK = 2 * C * C, W = 3 * C * C, Q = W + C * K, R = Q + C * K, G = R + C * K,
                       EG = G + C * K;
  static constexpr int size = (EG + K + 63) / 64 * 64;
};

struct Params {
  FwdParams f;
  bwd::TokenInputs x;         // the log-decay in x.dec
  int32_t* chunk_base;        // varlen chunk numbering, else null
  float* S0;                  // states at chunk starts [chunks, HV, K, V]
  float* fac;                 // factor blocks [chunks, HV, Fac::size]
  float* dS;                  // end-state gradients [chunks, HV, K, V]
  float *dDelta, *Delta, *dB;  // [B*T, HV, V] (delta rule)
  float *U, *X;                // the scans' inputs [B*T, HV, V]: Delta's and dDelta's slots with the delta rule
  float* dbeta_part;           // [V / VE, B*T, HV]
  float* part;                 // [B*T, HV, 3K + 1] (chain.h)
  bwd::GradIO io;  // d_out, d_final_state, d_initial_state, dv
  int64_t BT;
};

// Where a per-chunk CTA's chunk lies (chunk_tiles.cuh); false past the last chunk of a varlen call.
__device__ __forceinline__ bool chunk_at(const Params& bp, int cidx, ChunkAt& ch) {
  return bwd::chunk_at(bp.f, bp.chunk_base, cidx, ch);
}
// The (chunk, value head, column slice) of a per-chunk CTA whose grid runs over slices of `width`
// columns (of V or K), the slice fastest in blockIdx.x, then the value head.
struct ChunkSlice {
  int cidx, hv, col0;
};
__device__ __forceinline__ ChunkSlice chunk_slice(const FwdParams& p, int slices, int width) {
  const unsigned b = blockIdx.x;
  return {static_cast<int>(b / (static_cast<unsigned>(slices) * p.HV)), static_cast<int>((b / slices) % p.HV),
          static_cast<int>(b % slices) * width};
}

// The same for rows whose pitch leaves them unaligned for 16-byte copies (the part rows: 3 K + 1
// floats), by 4-byte copies.
template <int ROWS, int COLS, int THREADS = NT>
__device__ __forceinline__ void rows_async4(float* dst, int dst_ld, const float* src, int64_t src_ld, int valid = ROWS) {
  for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
    const int r = i / COLS, c = i % COLS;
    if (r < valid) mma::cp_async4(dst + r * dst_ld + c, src + r * src_ld + c);
    else dst[r * dst_ld + c] = 0.0f;
  }
}

// x = hi + lo, hi = bf16(x) (as a float), lo = x - hi.
__device__ __forceinline__ void hilo(float x, float& hi, float& lo) {
  hi = __bfloat162float(__float2bfloat16_rn(x));
  lo = x - hi;
}

// hilo for four values, each part as bf16 pairs packed as the tiles hold them (column c in the low
// half): hi + lo is within 2^-16 of x (relative). Paired conversions (one per two values): the
// scalar form through hilo costs the key kernel registers (it spills).
__device__ __forceinline__ void split_bf16x4(float4 x, uint2& hi, uint2& lo) {
  const uint32_t h01 = mma::pack(x.x, x.y), h23 = mma::pack(x.z, x.w);
  const float2 f01 = mma::unpack(h01), f23 = mma::unpack(h23);
  hi = make_uint2(h01, h23);
  lo = make_uint2(mma::pack(x.x - f01.x, x.y - f01.y), mma::pack(x.z - f23.x, x.w - f23.y));
}

// Four consecutive elements of a bf16, fp16 or fp32 tensor (8- or 16-byte aligned) as floats.
__device__ __forceinline__ float4 load4(const void* src, int dt, int64_t off) {
  if (dt == CULA_FLOAT32) return *reinterpret_cast<const float4*>(static_cast<const float*>(src) + off);
  const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(src) + off);
  const float2 a = dt == CULA_BFLOAT16 ? mma::unpack(w.x) : mma::unpack<__half>(w.x),
               b = dt == CULA_BFLOAT16 ? mma::unpack(w.y) : mma::unpack<__half>(w.y);
  return make_float4(a.x, a.y, b.x, b.y);
}

// Staging a fp32 matrix as bf16 hi / lo tiles in the 128-byte swizzle (wgmma.cuh), the hi tile at dst
// and the lo tile lo_off bytes after it, each of `rows` rows.
// Four values of row r from column c:
__device__ __forceinline__ void put_rows(unsigned char* dst, int lo_off, int rows, int r, int c, float4 x) {
  uint2 hi, lo;
  split_bf16x4(x, hi, lo);
  const int off = wg::sw128_offset(rows, r, c);
  *reinterpret_cast<uint2*>(dst + off) = hi;
  *reinterpret_cast<uint2*>(dst + lo_off + off) = lo;
}
// An element back from its hi / lo pair (hi at p, lo lo_off bytes after it).
__device__ __forceinline__ float tile_value(const unsigned char* p, int lo_off) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p)) +
         __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p + lo_off));
}
// Transposed: rows r (a) and r + 1 (b), columns c..c + 3, as the pairs (r, r + 1) at tile rows c..c + 3.
__device__ __forceinline__ void put_pairs_t(unsigned char* dst, int lo_off, int rows, int r, int c, float4 a, float4 b) {
  const float x0[4] = {a.x, a.y, a.z, a.w}, x1[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float h0, l0, h1, l1;
    hilo(x0[e], h0, l0);
    hilo(x1[e], h1, l1);
    const int off = wg::sw128_offset(rows, c + e, r);
    *reinterpret_cast<uint32_t*>(dst + off) = mma::pack(h0, h1);
    *reinterpret_cast<uint32_t*>(dst + lo_off + off) = mma::pack(l0, l1);
  }
}

// ---- 2. factors --------------------------------------------------------------------------------
// Channels per slice of the factor kernel: its q^, k^ and G tiles of 128 channels take most of the
// shared memory, so K = 256 runs as two slices.
constexpr int factor_slice(int K) { return K > 128 ? 128 : K; }
template <int K, bool DELTA>
struct FactorsLayout {
  static constexpr int LK = K + 4, LA = C + 4, LB = K + 8;
  static constexpr int kRowOperands = (16 + (DELTA ? 16 : 0) + 48) * LK;  // one block row's operands
  static constexpr int kTail = 3 * 256 + C * LB;                          // X, then beta Kg
  // the block rows' products (16 rows, 16 I columns) through gemm_wide: their scratch, two buffers
  static constexpr int SC = tf32::wide_scratch<16, 16, K, NW>();
  static constexpr int q = 0, k = q + C * LK, G = k + C * LK, A = G + C * LK, T = A + (DELTA ? C * LA : 0),
                       S = T + (DELTA ? C * LA : 0), D = S + (kRowOperands > kTail ? kRowOperands : kTail),
                       beta = D + 4 * 136 * 2, sc = beta + C, floats = sc + 2 * SC;
  static constexpr int bytes = floats * 4;
};

// The factor kernel's layout at key size K (its channel slices' tiles).
template <int K, bool DELTA>
using FactorsLayoutOf = FactorsLayout<factor_slice(K), DELTA>;

// The pair matrices summed over the channel slices (slice sl of NS): P_tj in the factor block as it
// goes; KEK_tj in Am until the last slice, which writes it out and leaves A_tj = beta_t KEK_tj in Am.
// Each element is owned by one thread in every slice.
__device__ __forceinline__ void add_p(float& f, float v, int sl) { f = sl == 0 ? v : f + v; }
__device__ __forceinline__ void add_kek(float& a, float& kek_out, float beta_t, float v, int sl, int NS) {
  const float kek = sl == 0 ? v : a + v;
  if (sl == NS - 1) {
    kek_out = kek;
    a = beta_t * kek;
  } else {
    a = kek;
  }
}

__device__ __forceinline__ void tri_index(int pi, int& i, int& j) {  // pi = i (i + 1) / 2 + j, j <= i
  i = static_cast<int>((sqrtf(8.0f * pi + 1.0f) - 1.0f) * 0.5f);
  while ((i + 1) * (i + 2) / 2 <= pi) ++i;
  while (i * (i + 1) / 2 > pi) --i;
  j = pi - i * (i + 1) / 2;
}

// P and KEK for the rows of block I (I >= 1) and the tokens before it, on tensor cores: both
// operands through the last token before the block, r = 16 I - 1: (q_t e^{G_t - G_r}) (k_s
// e^{G_r - G_s}), every factor <= 1. Channels of slice sl of NS (KC each): the products are added
// to the slices before (P in the factor block, KEK in Am; each element owned by one thread in every
// slice) and KEK goes out, with A = diag(beta) KEK in Am, after the last.
template <int KC, int K, bool DELTA, int I, int PREC>
__device__ __forceinline__ void factors_block_row(const float* qs, const float* ks, const float* Gs, float* S, float* Am,
                                                  const float* bet, float* fac, float* sc0, float* sc1, int sl, int NS) {
  using Ly = FactorsLayout<KC, DELTA>;
  using F = Fac<K>;
  constexpr int LK = Ly::LK, LA = Ly::LA, r = 16 * I - 1;
  float *Lq = S, *Lk = S + 16 * LK, *R = S + (DELTA ? 32 : 16) * LK;
  __syncthreads();  // S free
  for (int i = threadIdx.x; i < 16 * KC; i += NT) {
    const int t = 16 * I + i / KC, c = i % KC;
    const float e = fast_exp(Gs[t * LK + c] - Gs[r * LK + c]);
    Lq[(i / KC) * LK + c] = qs[t * LK + c] * e;
    if (DELTA) Lk[(i / KC) * LK + c] = ks[t * LK + c] * e;
  }
  for (int i = threadIdx.x; i < 16 * I * KC; i += NT) {
    const int s = i / KC, c = i % KC;
    R[s * LK + c] = ks[s * LK + c] * fast_exp(Gs[r * LK + c] - Gs[s * LK + c]);
  }
  __syncthreads();
  static_assert(tf32::wide_scratch<16, 16 * I, KC, NW>() <= Ly::SC, "scratch");
  tf32::gemm_wide<16, 16 * I, KC, NW, PREC>(rows(Lq, LK), cols(R, LK), sc0,
                                      [&](int i, int j, float v) { add_p(fac[F::P + (16 * I + i) * C + j], v, sl); });
  if (DELTA)
    tf32::gemm_wide<16, 16 * I, KC, NW, PREC>(rows(Lk, LK), cols(R, LK), sc1, [&](int i, int j, float v) {
      const int t = 16 * I + i;
      add_kek(Am[t * LA + j], fac[F::KEK + t * C + j], bet[t], v, sl, NS);
    });
}

// The diagonal 16 x 16 blocks of P and KEK, exact: every pair (t, s), s <= t, of block I through its own
// e^{G_t - G_s} per channel, summed over the slices in D (pair e = 136 I + t'(t'+1)/2 + s' of block
// rows t', s': P's part at D[2 e], KEK's at D[2 e + 1]). Warp w takes the block rows a = w % 8 and
// b = 15 - a (a + 1 and 16 - a pairs: 17 a warp, every warp alike) of blocks 2 (w / 8) and 2 (w / 8) + 1,
// a half-warp each; lane l of a half the channels l, l + 16, ...: one pass over them loads q^, k^ and G
// of the two rows once and k^ and G of each column row once for both rows; then the half-warp's sums
// by shuffles. (The two half-warps' rows are 16 rows apart, which share banks: they walk their channels
// 16 apart.)
template <int KC, bool DELTA>
__device__ __forceinline__ void factors_diagonal_blocks(const float* qs, const float* ks, const float* Gs, float* D, int sl) {
  using Ly = FactorsLayout<KC, DELTA>;
  constexpr int LK = Ly::LK, CPL = KC / 16;
  static_assert(NT == 512 && KC % 16 == 0, "16 warps: 8 row pairs x 2 block pairs; channels by 16");
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, half = lane >> 4, cl = lane & 15;
  const int I = 2 * (w >> 3) + half, a = w & 7, b = 15 - a;
  const float *r0 = ks + 16 * I * LK, *g0 = Gs + 16 * I * LK;  // the block's column rows
  const int ra = (16 * I + a) * LK, rb = (16 * I + b) * LK;
  float pa[8], xa[8], pb[16], xb[16];  // the rows' sums (P, KEK) with column row s' of the block
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    pb[j] = xb[j] = 0.0f;
    if (j < 8) pa[j] = xa[j] = 0.0f;
  }
#pragma unroll 2
  for (int m = 0; m < CPL; ++m) {
    const int c = ((m + half) % CPL) * 16 + cl;
    const float qa = qs[ra + c], ka = ks[ra + c], ga = Gs[ra + c], qb = qs[rb + c], kb = ks[rb + c], gb = Gs[rb + c];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (j <= b) {  // (a, b and so these tests: the same on the whole warp)
        const float kv = r0[j * LK + c], gv = g0[j * LK + c];
        const float eb = kv * fast_exp(gb - gv);
        pb[j] += qb * eb;
        if (DELTA) xb[j] += kb * eb;
        if (j < 8 && j <= a) {
          const float ea = kv * fast_exp(ga - gv);
          pa[j] += qa * ea;
          if (DELTA) xa[j] += ka * ea;
        }
      }
    }
  }
  auto put = [&](int row, int j, float vp, float vx) {  // the half-warp's sum of pair (row, j), by lane j
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) {
      vp += __shfl_xor_sync(0xffffffffu, vp, o);
      if (DELTA) vx += __shfl_xor_sync(0xffffffffu, vx, o);
    }
    if (cl == j) {
      const int e = 136 * I + row * (row + 1) / 2 + j;
      D[2 * e] = sl == 0 ? vp : D[2 * e] + vp;
      D[2 * e + 1] = sl == 0 ? vx : D[2 * e + 1] + vx;
    }
  };
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j <= b) put(b, j, pb[j], xb[j]);
    if (j < 8 && j <= a) put(a, j, pa[j], xa[j]);
  }
}

template <int K, bool DELTA, bool SCALAR, int PREC>
__global__ void __launch_bounds__(NT) chunk_factors_kernel(const Params bp) {
  // the channels in slices of KC (K = 256: two; the pair matrices summed over the slices, T formed
  // once they are complete, W by slices after it)
  constexpr int KC = factor_slice(K), NS = K / KC;
  using Ly = FactorsLayoutOf<K, DELTA>;
  using F = Fac<K>;
  constexpr int LK = Ly::LK, LA = Ly::LA, LB = Ly::LB;
  extern __shared__ __align__(16) float sm[];
  float *qs = sm + Ly::q, *ks = sm + Ly::k, *Gs = sm + Ly::G, *Am = sm + Ly::A, *Tm = sm + Ly::T, *S = sm + Ly::S;
  float *D = sm + Ly::D, *bet = sm + Ly::beta;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, lane = tid & 31;
  const int cidx = static_cast<int>(blockIdx.x / p.HV), hv = static_cast<int>(blockIdx.x % p.HV);
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!chunk_at(bp, cidx, ch)) return;
  float* fac = bp.fac + (static_cast<int64_t>(cidx) * p.HV + hv) * F::size;
  const int Lc = ch.Lc;

  // channels c0 .. c0 + KC of k^ (and q^) and of the log-decay, G its cumulative sum over the chunk
  auto load_slice = [&](int c0, bool with_q) {
    if (with_q) rows_async<C, KC>(qs, LK, bp.x.qh + (ch.f0 * p.H + h) * K + c0, static_cast<int64_t>(p.H) * K, Lc);
    rows_async<C, KC>(ks, LK, bp.x.kh + (ch.f0 * p.H + h) * K + c0, static_cast<int64_t>(p.H) * K, Lc);
    rows_async<C, KC>(Gs, LK, bp.x.dec + (ch.f0 * p.HV + hv) * K + c0, static_cast<int64_t>(p.HV) * K, Lc);  // rows past: no decay
    mma::cp_async_commit();
  };
  auto cumulate = [&]() {
    mma::cp_async_wait_all();
    __syncthreads();
    for (int c = tid; c < KC; c += NT) {
      float acc = 0.0f;
      for (int t = 0; t < C; ++t) acc = Gs[t * LK + c] += acc;
    }
    __syncthreads();
  };

  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  for (int i = tid; i < C * C; i += NT) {
    const int t = i / C, s = i % C;
    if (s > t) fac[F::P + i] = 0.0f;
    if (DELTA && s >= t) fac[F::KEK + i] = 0.0f, Am[t * LA + s] = 0.0f;
  }
  for (int sl = 0; sl < NS; ++sl) {
    const int c0 = sl * KC;
    __syncthreads();  // the slice before is done with q^, k^ and G
    load_slice(c0, true);
    cumulate();
    if (SCALAR) {
      // one decay for every channel: P = (q^ k^T) o E and KEK = (k^ k^T) o E, E_ts = e^{G_t - G_s} <= 1
      // for s <= t, whole on tensor cores, summed over the slices as the block rows below are
      tf32::gemm<C, C, KC, NW, 2, PREC>(rows(qs, LK), cols(ks, LK), [&](int t, int j, float v) {
        if (j <= t) add_p(fac[F::P + t * C + j], v * fast_exp(Gs[t * LK] - Gs[j * LK]), sl);
      });
      if (DELTA)
        tf32::gemm<C, C, KC, NW, 2, PREC>(rows(ks, LK), cols(ks, LK), [&](int t, int j, float v) {
          if (j < t) add_kek(Am[t * LA + j], fac[F::KEK + t * C + j], bet[t], v * fast_exp(Gs[t * LK] - Gs[j * LK]), sl, NS);
        });
    } else {
      factors_diagonal_blocks<KC, DELTA>(qs, ks, Gs, D, sl);
      factors_block_row<KC, K, DELTA, 1, PREC>(qs, ks, Gs, S, Am, bet, fac, sm + Ly::sc, sm + Ly::sc + Ly::SC, sl, NS);
      factors_block_row<KC, K, DELTA, 2, PREC>(qs, ks, Gs, S, Am, bet, fac, sm + Ly::sc, sm + Ly::sc + Ly::SC, sl, NS);
      factors_block_row<KC, K, DELTA, 3, PREC>(qs, ks, Gs, S, Am, bet, fac, sm + Ly::sc, sm + Ly::sc + Ly::SC, sl, NS);
    }
    // G, Qg = q^ e^G, Kr = k^ e^{G_C - G}, e^{G_C} of the slice's channels
    for (int i = tid; i < C * KC; i += NT) {
      const int t = i / KC, c = i % KC;
      const float G = Gs[t * LK + c];
      fac[F::G + t * K + c0 + c] = G;
      fac[F::Q + t * K + c0 + c] = qs[t * LK + c] * fast_exp(G);
      fac[F::R + t * K + c0 + c] = ks[t * LK + c] * fast_exp(Gs[(C - 1) * LK + c] - G);
    }
    for (int c = tid; c < KC; c += NT) fac[F::EG + c0 + c] = fast_exp(Gs[(C - 1) * LK + c]);
  }
  __syncthreads();
  if (!SCALAR) {
    for (int e = tid; e < 4 * 136; e += NT) {  // the diagonal blocks' sums
      const int I = e / 136;
      int i, j;
      tri_index(e % 136, i, j);
      const int t = 16 * I + i, s = 16 * I + j;
      fac[F::P + t * C + s] = D[2 * e];
      if (DELTA && j < i) {
        fac[F::KEK + t * C + s] = D[2 * e + 1];
        Am[t * LA + s] = bet[t] * D[2 * e + 1];
      }
    }
  }
  if (!DELTA) return;

  // T = (I + A)^-1, A strictly lower: diagonal 16 x 16 blocks by substitution (thread per
  // column), then block diagonal d = 1..3: T_IJ = -T_II sum_{J <= L < I} A_IL T_LJ
  float* X = S;
  __syncthreads();
  for (int i = tid; i < C * C; i += NT) {
    const int rr = i / C, cc = i % C;
    if (cc / 16 > rr / 16) Tm[rr * LA + cc] = 0.0f;
  }
  // (the thread's column of its diagonal block in registers: T_lj for l < j is 0, so the terms before
  // the column's diagonal add nothing and every step's sum runs over compile-time l)
  if (tid < C) {
    const int b = 16 * (tid / 16), j = tid % 16;
    float col[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float v = i == j ? 1.0f : 0.0f;
#pragma unroll
      for (int l = 0; l < i; ++l) v -= Am[(b + i) * LA + b + l] * col[l];
      col[i] = v;
      Tm[(b + i) * LA + b + j] = v;
    }
  }
  __syncthreads();
#pragma unroll
  for (int d = 1; d < 4; ++d) {  // (unrolled: each diagonal's sums of compile-time length)
    const int nb = 4 - d;
    for (int e = tid; e < nb * 256; e += NT) {
      const int I = d + e / 256, J = I - d, i = (e % 256) / 16, j = e % 16;
      const float *a = Am + (16 * I + i) * LA + 16 * J, *t = Tm + 16 * J * LA + 16 * J + j;
      float v = 0.0f;
#pragma unroll
      for (int l = 0; l < 16 * d; ++l) v += a[l] * t[l * LA];
      X[e] = v;
    }
    __syncthreads();
    for (int e = tid; e < nb * 256; e += NT) {
      const int I = d + e / 256, J = I - d, i = (e % 256) / 16, j = e % 16;
      const float* x = X + (e / 256) * 256;
      const float* t = Tm + (16 * I + i) * LA + 16 * I;  // T_II's row i: 0 past its diagonal
      float v = 0.0f;
#pragma unroll
      for (int m = 0; m < 16; ++m) v -= t[m] * x[m * 16 + j];
      Tm[(16 * I + i) * LA + 16 * J + j] = v;
    }
    __syncthreads();
  }
  for (int i = tid; i < C * C; i += NT) fac[F::T + i] = Tm[(i / C) * LA + i % C];

  // W = T diag(beta) Kg by slices of channels, the last slice's k^ and G still in shared memory
  float* bKg = S + 3 * 256;
  for (int sl = NS - 1; sl >= 0; --sl) {
    const int c0 = sl * KC;
    if (sl != NS - 1) {
      __syncthreads();  // the slice after is done with k^, G and beta Kg
      load_slice(c0, false);
      cumulate();
    }
    for (int i = tid; i < C * KC; i += NT) {
      const int t = i / KC, c = i % KC;
      bKg[t * LB + c] = bet[t] * ks[t * LK + c] * fast_exp(Gs[t * LK + c]);
    }
    __syncthreads();
    tf32::gemm<C, KC, C, NW, 2, PREC>(rows(Tm, LA), rows(bKg, LB), [&](int i, int j, float v) { fac[F::W + i * K + c0 + j] = v; });
  }
}

// ---- 3. the scans' inputs -----------------------------------------------------------------------
// What the scans add and do not carry, formed per (chunk, value head, 64 columns) in parallel so
// that a scan step holds only the two products that depend on the carried state:
//   U = T (beta v) (the delta rule; without it U = v),  X = P^T dO,  Y = Qg^T dO.
// U goes to the Delta slot (the value kernel overwrites it), X to the dDelta slot (the gradient scan
// overwrites each chunk's rows with dDelta after reading them), Y to the chunk's dS slot (the
// gradient scan overwrites it with dS after reading it).
template <int K>
struct ScanInputsLayout {
  static constexpr int LP = C + 8, LQ = K + 8, LT = C + 4, LV = VE + 8;
  static constexpr int P = 0, Qg = P + C * LP, T = Qg + C * LQ, dO = T + C * LT, bv = dO + C * LV, beta = bv + C * LV,
                       floats = beta + C;
  static constexpr int bytes = floats * 4;
};

// sm_90a (K <= 128): every operand staged as it lies in memory, rows along the products' k (tokens),
// as bf16 hi / lo tiles: P, Qg, T, dO and beta v (bytes below); the products that read P, Qg, dO and
// beta v transposed take them MN-major (wgmma.cuh desc_mn). One warpgroup a product of 64 x 64:
// X, U (the delta rule), and Y's row blocks of 64 channels.
template <int K>
struct ScanInputsTiles {
  static constexpr int kC = C * C * 2, kQ = C * K * 2;
  static constexpr int P = 0, Qg = 2 * kC, dO = Qg + 2 * kQ, T = dO + 2 * kC, bv = T + 2 * kC, beta = bv + 2 * kC,
                       bytes = beta + C * 4;
  static_assert(K > 128 || bytes <= ScanInputsLayout<K>::bytes, "the tiles take more than the launch's shared memory");
};

template <int K, bool DELTA>
__device__ __forceinline__ void scan_inputs_wg(unsigned char* sb, const Params& bp, const ChunkAt& ch, const float* fac,
                                               int cidx, int hv, int v0) {
  using Ty = ScanInputsTiles<K>;
  using F = Fac<K>;
  const FwdParams& p = bp.f;
  const uint32_t base = mma::smem_addr(sb);
  float* bet = reinterpret_cast<float*>(sb + Ty::beta);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, Lc = ch.Lc;
  const int role = warp / 4, w4 = warp & 3, g = lane >> 2, q2 = (lane & 3) * 2;
  const int64_t tok = ch.f0 * p.HV * p.V + hv * p.V + v0, tok_ld = static_cast<int64_t>(p.HV) * p.V;
  const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  for (int i = tid; i < C * (C / 4); i += NT) {  // P and T (rows: tokens)
    const int t = i / (C / 4), c = (i % (C / 4)) * 4;
    put_rows(sb + Ty::P, Ty::kC, C, t, c, *reinterpret_cast<const float4*>(fac + F::P + t * C + c));
    if (DELTA) put_rows(sb + Ty::T, Ty::kC, C, t, c, *reinterpret_cast<const float4*>(fac + F::T + t * C + c));
  }
#pragma unroll 2
  for (int i = tid; i < C * (K / 4); i += NT) {  // Qg
    const int t = i / (K / 4), c = (i % (K / 4)) * 4;
    put_rows(sb + Ty::Qg, Ty::kQ, C, t, c, *reinterpret_cast<const float4*>(fac + F::Q + t * K + c));
  }
  __syncthreads();  // beta in
  for (int i = tid; i < C * (VE / 4); i += NT) {  // dO and beta v (U = v without the delta rule); zeros past the chunk
    const int t = i / (VE / 4), c = (i % (VE / 4)) * 4;
    const bool in = t < Lc;
    put_rows(sb + Ty::dO, Ty::kC, C, t, c,
             in ? load4(bp.io.dO, bp.io.dO_dt,
                        ch.b_row * bp.io.dO_s[0] + (ch.t0 + t) * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0 + c)
                : z);
    const float4 v = in ? load4(p.v, p.v_dt, ch.b_row * p.v_s[0] + (ch.t0 + t) * p.v_s[1] + hv * p.v_s[2] + v0 + c) : z;
    if (DELTA) {
      const float b = bet[t];
      put_rows(sb + Ty::bv, Ty::kC, C, t, c, make_float4(b * v.x, b * v.y, b * v.z, b * v.w));
    } else if (in) {
      *reinterpret_cast<float4*>(bp.U + tok + t * tok_ld + c) = v;
    }
  }
  wg::fence_proxy_async();
  __syncthreads();
  // role 0: X = P^T dO; role 1: U = T (beta v); roles 2, 3: Y = Qg^T dO, channels [64 (role - 2), +64)
  const bool active = role == 0 || (role == 1 && DELTA) || (role >= 2 && 64 * (role - 2) < K);
  if (!active) return;
  float acc[8][4] = {};
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {
    const uint64_t dh = wg::desc_mn(base + Ty::dO, C, kk, 0), dl = wg::desc_mn(base + Ty::dO + Ty::kC, C, kk, 0);
    if (role == 0) {
      const uint64_t ah = wg::desc_mn(base + Ty::P, C, kk, 0), al = wg::desc_mn(base + Ty::P + Ty::kC, C, kk, 0);
      wg::mma_bf16_n64<1, 1>(acc, ah, dh);
      wg::mma_bf16_n64<1, 1>(acc, ah, dl);
      wg::mma_bf16_n64<1, 1>(acc, al, dh);
    } else if (role == 1) {
      const uint64_t ah = wg::desc_kstep(base + Ty::T, C, 0, kk), al = wg::desc_kstep(base + Ty::T + Ty::kC, C, 0, kk);
      const uint64_t bh = wg::desc_mn(base + Ty::bv, C, kk, 0), bl = wg::desc_mn(base + Ty::bv + Ty::kC, C, kk, 0);
      wg::mma_bf16_n64<0, 1>(acc, ah, bh);
      wg::mma_bf16_n64<0, 1>(acc, ah, bl);
      wg::mma_bf16_n64<0, 1>(acc, al, bh);
    } else {
      const int m0 = 64 * (role - 2);
      const uint64_t ah = wg::desc_mn(base + Ty::Qg, C, kk, m0), al = wg::desc_mn(base + Ty::Qg + Ty::kQ, C, kk, m0);
      wg::mma_bf16_n64<1, 1>(acc, ah, dh);
      wg::mma_bf16_n64<1, 1>(acc, ah, dl);
      wg::mma_bf16_n64<1, 1>(acc, al, dh);
    }
  }
  wg::commit();
  wg::wait_all();
  wg::fence_operand(acc);
  float* Y = bp.dS + (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V + v0;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = 16 * w4 + g + 8 * hr;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = 8 * j + q2;
      const float2 x = make_float2(acc[j][2 * hr], acc[j][2 * hr + 1]);
      if (role == 0 && r < Lc) *reinterpret_cast<float2*>(bp.X + tok + r * tok_ld + c) = x;
      if (role == 1 && r < Lc) *reinterpret_cast<float2*>(bp.U + tok + r * tok_ld + c) = x;
      if (role >= 2) *reinterpret_cast<float2*>(Y + static_cast<int64_t>(64 * (role - 2) + r) * p.V + c) = x;
    }
  }
}

template <int K, bool DELTA, int PREC>
__global__ void __launch_bounds__(NT, 2) scan_inputs_kernel(const Params bp) {
  using Ly = ScanInputsLayout<K>;
  using F = Fac<K>;
  constexpr int LP = Ly::LP, LQ = Ly::LQ, LT = Ly::LT, LV = Ly::LV;
  extern __shared__ __align__(1024) float sm[];  // (the bf16 tiles' swizzle repeats every 1024 bytes)
  float *Pm = sm + Ly::P, *Qg = sm + Ly::Qg, *Tm = sm + Ly::T, *dO = sm + Ly::dO, *bv = sm + Ly::bv, *bet = sm + Ly::beta;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x;
  const ChunkSlice cs = chunk_slice(p, p.V / VE, VE);
  const int cidx = cs.cidx, hv = cs.hv, v0 = cs.col0;
  ChunkAt ch;
  if (!chunk_at(bp, cidx, ch)) return;
  const float* fac = bp.fac + (static_cast<int64_t>(cidx) * p.HV + hv) * F::size;
  const int Lc = ch.Lc;
  const int64_t tok = ch.f0 * p.HV * p.V + hv * p.V + v0, tok_ld = static_cast<int64_t>(p.HV) * p.V;

  if constexpr (CULA_WGMMA && K <= 128) {
    scan_inputs_wg<K, DELTA>(reinterpret_cast<unsigned char*>(sm), bp, ch, fac, cidx, hv, v0);
    return;
  }
  rows_async<C, C>(Pm, LP, fac + F::P, C);
  rows_async<C, K>(Qg, LQ, fac + F::Q, K);
  if (DELTA) rows_async<C, C>(Tm, LT, fac + F::T, C);
  mma::cp_async_commit();
  input_rows<C, VE>(dO, LV, bp.io.dO, bp.io.dO_dt, ch.b_row * bp.io.dO_s[0] + ch.t0 * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0,
                    bp.io.dO_s[1], Lc);
  input_rows<C, VE>(bv, LV, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0, p.v_s[1], Lc);
  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  mma::cp_async_wait_all();
  __syncthreads();
  tf32::gemm<C, VE, C, NW, 2, PREC>(cols(Pm, LP), rows(dO, LV), [&](int i, int j, float v) {
    if (i < Lc) bp.X[tok + i * tok_ld + j] = v;
  });
  float* Y = bp.dS + (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V + v0;
  tf32::gemm<K, VE, C, NW, 2, PREC>(cols(Qg, LQ), rows(dO, LV), [&](int i, int j, float v) { Y[i * static_cast<int64_t>(p.V) + j] = v; });
  if (DELTA) {
    tf32::gemm<C, VE, C, NW, 2, PREC>(rows(Tm, LT), RowScaled{bv, LV, bet}, [&](int i, int j, float v) {
      if (i < Lc) bp.U[tok + i * tok_ld + j] = v;
    });
  } else {
    for (int i = tid; i < Lc * VE; i += NT) bp.U[tok + (i / VE) * tok_ld + i % VE] = bv[(i / VE) * LV + i % VE];
  }
}

// ---- 4. the state scans ------------------------------------------------------------------------
// One launch, two roles on alternate CTAs (block 2 i: the states of slice i, block 2 i + 1: their
// gradients), which do not depend on each other: the two serial chains run side by side, two CTAs
// per SM, each CTA one (sequence, value head, VS columns):
//   states, chunks in order:     S0 = S;  Delta = U - W S;         S <- e^{G_C} S + Kr^T Delta
//   gradients, last to first:    dS_end = dS;  dDelta = X + Kr dS;  dS <- e^{G_C} dS + Y - W^T dDelta
// (without the delta rule Delta = U = v, dDelta is dv and W drops out). S0 and dS_end are written
// from the update's epilogue, which hands each element to one thread once, so no extra barrier.
// Loads run one phase ahead by cp.async: group A (what the first product needs) of the next chunk
// while this chunk's update runs, group B (the update's) while the next chunk's first product runs.
// Eight warps: a step's products have 4 and 8 tiles of 16 x 16, so more warps would idle.
constexpr int SW = 8, ST = 32 * SW;
template <int K, bool DELTA, int VS>
struct ScanLayout {
  static constexpr int LS = VS + 8, LR = K + 4, LQ = K + 8;
  // states: S, U, Delta, W (rows, A operand), Kr (columns, A operand), e^{G_C}
  static constexpr int fS = 0, fU = fS + K * LS, fD = fU + C * LS, fW = fD + (DELTA ? C * LS : 0),
                       fKr = fW + (DELTA ? C * LR : 0), fEg = fKr + C * LQ, f_floats = fEg + K;
  // gradients: dS, X, Y, dDelta, Kr (rows), W (columns), e^{G_C}
  static constexpr int gS = 0, gX = gS + K * LS, gY = gX + C * LS, gD = gY + K * LS, gKr = gD + C * LS, gW = gKr + C * LR,
                       gEg = gW + (DELTA ? C * LQ : 0), g_floats = gEg + K;
  static constexpr int bytes = (f_floats > g_floats ? f_floats : g_floats) * 4;
};

template <int K, bool DELTA, int VS, int PREC>
__device__ __forceinline__ void state_scan(const Params& bp, float* sm, const chunk::SliceTask& tk) {
  using Ly = ScanLayout<K, DELTA, VS>;
  using F = Fac<K>;
  constexpr int LS = Ly::LS, LR = Ly::LR, LQ = Ly::LQ;
  float *S = sm + Ly::fS, *U = sm + Ly::fU, *Dl = DELTA ? sm + Ly::fD : U, *W = sm + Ly::fW, *Kr = sm + Ly::fKr;
  float* eg = sm + Ly::fEg;
  const FwdParams& p = bp.f;
  const int hv = tk.hv, v0 = tk.v0, nch = tk.nchunks;
  const int64_t tok_ld = static_cast<int64_t>(p.HV) * p.V;
  auto fac_of = [&](int ci) { return bp.fac + ((tk.cbase + ci) * p.HV + hv) * F::size; };
  auto u_rows = [&](int ci) {
    const ChunkAt ch = chunk_in(p, tk.sq, ci);
    rows_async<C, VS, ST>(U, LS, bp.U + ch.f0 * tok_ld + hv * p.V + v0, tok_ld, ch.Lc);
  };
  auto load_a = [&](int ci) {
    if (DELTA) {
      u_rows(ci);
      rows_async<C, K, ST>(W, LR, fac_of(ci) + F::W, K);
    }
    mma::cp_async_commit();
  };
  auto load_b = [&](int ci) {
    if (!DELTA) u_rows(ci);
    rows_async<C, K, ST>(Kr, LQ, fac_of(ci) + F::R, K);
    rows_async<1, K, ST>(eg, K, fac_of(ci) + F::EG, K);
    mma::cp_async_commit();
  };
  slice_in<K, VS, ST>(S, LS, p, p.h0, p.h0_dt, tk.n, hv, v0);
  if (nch > 0) load_a(0), load_b(0);
  for (int ci = 0; ci < nch; ++ci) {
    mma::cp_async_wait_pending(1);  // group A of this chunk
    __syncthreads();                // (and S written)
    if (DELTA) {
      tf32::gemm<C, VS, K, SW, 2, PREC>(rows(W, LR), rows(S, LS), [&](int i, int j, float v) { Dl[i * LS + j] = U[i * LS + j] - v; });
      __syncthreads();  // U, W read
    }
    if (ci + 1 < nch) load_a(ci + 1);
    mma::cp_async_wait_pending(ci + 1 < nch ? 1 : 0);  // group B of this chunk
    __syncthreads();
    float* S0 = bp.S0 + ((tk.cbase + ci) * p.HV + hv) * static_cast<int64_t>(K) * p.V + v0;
    tf32::gemm<K, VS, C, SW, 2, PREC>(cols(Kr, LQ), rows(Dl, LS), [&](int i, int j, float v) {
      const float s = S[i * LS + j];
      S0[i * static_cast<int64_t>(p.V) + j] = s;  // the chunk's start state
      S[i * LS + j] = eg[i] * s + v;
    });
    __syncthreads();  // Kr, e^{G_C} and Delta read
    if (ci + 1 < nch) load_b(ci + 1);
  }
}

template <int K, bool DELTA, int VS, int PREC>
__device__ __forceinline__ void state_grad_scan(const Params& bp, float* sm, const chunk::SliceTask& tk) {
  using Ly = ScanLayout<K, DELTA, VS>;
  using F = Fac<K>;
  constexpr int LS = Ly::LS, LR = Ly::LR, LQ = Ly::LQ;
  float *dS = sm + Ly::gS, *X = sm + Ly::gX, *Y = sm + Ly::gY, *dD = sm + Ly::gD, *Kr = sm + Ly::gKr, *W = sm + Ly::gW;
  float* eg = sm + Ly::gEg;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, hv = tk.hv, v0 = tk.v0, nch = tk.nchunks;
  const int64_t tok_ld = static_cast<int64_t>(p.HV) * p.V;
  auto fac_of = [&](int ci) { return bp.fac + ((tk.cbase + ci) * p.HV + hv) * F::size; };
  auto ds_of = [&](int ci) { return bp.dS + ((tk.cbase + ci) * p.HV + hv) * static_cast<int64_t>(K) * p.V + v0; };
  auto load_a = [&](int ci) {
    const ChunkAt ch = chunk_in(p, tk.sq, ci);
    rows_async<C, VS, ST>(X, LS, bp.X + ch.f0 * tok_ld + hv * p.V + v0, tok_ld, ch.Lc);
    rows_async<C, K, ST>(Kr, LR, fac_of(ci) + F::R, K);
    mma::cp_async_commit();
  };
  auto load_b = [&](int ci) {
    rows_async<K, VS, ST>(Y, LS, ds_of(ci), p.V);
    if (DELTA) rows_async<C, K, ST>(W, LQ, fac_of(ci) + F::W, K);
    rows_async<1, K, ST>(eg, K, fac_of(ci) + F::EG, K);
    mma::cp_async_commit();
  };
  slice_in<K, VS, ST>(dS, LS, p, bp.io.dht, bp.io.dht_dt, tk.n, hv, v0);
  if (nch > 0) load_a(nch - 1), load_b(nch - 1);
  for (int ci = nch - 1; ci >= 0; --ci) {
    const ChunkAt ch = chunk_in(p, tk.sq, ci);
    mma::cp_async_wait_pending(1);  // group A of this chunk
    __syncthreads();                // (and dS written)
    tf32::gemm<C, VS, K, SW, 2, PREC>(rows(Kr, LR), rows(dS, LS), [&](int i, int j, float v) { dD[i * LS + j] = X[i * LS + j] + v; });
    __syncthreads();  // X, Kr and dS read
    if (ci > 0) load_a(ci - 1);
    for (int i = tid; i < ch.Lc * VS; i += ST) {
      const int t = i / VS, j = i % VS;
      if (DELTA) bp.X[(ch.f0 + t) * tok_ld + hv * p.V + v0 + j] = dD[t * LS + j];  // dDelta, over X's rows
      else if (bp.io.dv)
        st(bp.io.dv, bp.io.dv_dt, ch.b_row * bp.io.dv_s[0] + (ch.t0 + t) * bp.io.dv_s[1] + hv * bp.io.dv_s[2] + (v0 + j) * bp.io.dv_s[3], dD[t * LS + j]);
    }
    mma::cp_async_wait_pending(ci > 0 ? 1 : 0);  // group B of this chunk
    __syncthreads();
    float* dSg = ds_of(ci);
    auto update = [&](int i, int j, float v) {
      const float d = dS[i * LS + j];
      dSg[i * static_cast<int64_t>(p.V) + j] = d;  // the chunk's end-state gradient, over Y
      dS[i * LS + j] = eg[i] * d + Y[i * LS + j] - v;
    };
    if (DELTA) {
      tf32::gemm<K, VS, C, SW, 2, PREC>(cols(W, LQ), rows(dD, LS), update);
    } else {
      for (int i = tid; i < K * VS; i += ST) update(i / VS, i % VS, 0.0f);
    }
    __syncthreads();  // Y, W, e^{G_C} and dDelta read; dS written
    if (ci > 0) load_b(ci - 1);
  }
  __syncthreads();
  if (bp.io.dh0) slice_out<K, VS, ST>(bp.io.dh0, bp.io.dh0_dt, p, tk.n, hv, v0, dS, LS);
}

// sm_90a, the delta rule, K <= 128, VS = 32 or 64 columns: both roles as one loop over a sequence's
// chunks (the gradients last to first) with the carried matrix (S, or dS) in registers, fp32, as the
// accumulators of the update's product: warpgroup i holds its rows (channels) 64 i .. 64 i + 63 of
// the K x VS slice. A step, between three barriers:
//   B1  the carried matrix, transposed and times -1 for the states, into bf16 hi / lo tiles
//       (stmatrix.trans); the step's left operands staged before it;
//   P1  each warpgroup half the columns of the first product over K, its accumulators starting at
//       the addend: Delta = U + W (-S), or dDelta = X + Kr dS; meanwhile the carried matrix out
//       (S0, or dS_end over Y);
//   B2  Delta^T (or -dDelta^T) into hi / lo tiles; then the next chunk's first left operand staged
//       into the tile P1 has read;
//   P2  each warpgroup its 64 rows of the update over the chunk's tokens: S <- e^{G_C} S + Kr^T
//       Delta, or dS <- e^{G_C} dS + Y - W^T dDelta, the left operand read MN-major (desc_mn) from
//       the tile it was staged in as it lies (rows: tokens);
//   B3  the next chunk's second left operand staged into the tile P2 has read.
// Each product bf16x3 (hi hi' + hi lo' + lo hi'). Everything a step reads from global memory is
// loaded a whole step ahead into registers (ncu: with half a step or less, the steps waited on those
// loads): the left operands' fp32 rows (W and Kr of the factor block, split as they are staged), the
// addend rows, e^{G_C} and Y. So one CTA per SM (about 150 registers a thread).
template <int K, bool DELTA, int VS>
constexpr bool wg_scan() {
  return DELTA && K <= 128 && (VS == 32 || VS == 64);
}
template <int K, int VS>
struct ScanTiles {  // bytes: the first product's left operand (W, or Kr for the gradients), the
                    // update's (Kr, or W), the carried matrix^T (VS x K), the first result^T (VS x C)
  static constexpr int kM = C * K * 2, kS = VS * K * 2, kD = VS * C * 2;
  static constexpr int A = 0, B = 2 * kM, S = B + 2 * kM, D = S + 2 * kS, bytes = D + 2 * kD;
};

// A C x K fp32 row-major tile on its way from global memory to a hi / lo tile, in registers.
template <int K>
struct RowsInFlight {
  static constexpr int N = C * K / 4 / ST;
  float4 r[N];
  __device__ __forceinline__ void load(const float* src) {
#pragma unroll
    for (int u = 0; u < N; ++u) r[u] = *reinterpret_cast<const float4*>(src + 4 * (threadIdx.x + u * ST));
  }
  __device__ __forceinline__ void put(unsigned char* dst) const {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int i = threadIdx.x + u * ST;
      put_rows(dst, C * K * 2, C, i / (K / 4), (i % (K / 4)) * 4, r[u]);
    }
  }
};

// A warp's accumulator fragments (16 x 8 NT from row r0, column c0), times sign, stored transposed
// as bf16 hi / lo tiles of `rows` rows at shared addresses hi and hi + lo_off.
template <int NT>
__device__ __forceinline__ void store_t_hilo(uint32_t hi, int lo_off, int rows, int r0, int c0, const float (&d)[NT][4],
                                             float sign, int lane) {
  float h[NT][4], l[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const float x0 = sign * d[j][e], x1 = sign * d[j][e + 1];
      const float2 f = mma::unpack(mma::pack(x0, x1));
      h[j][e] = f.x, h[j][e + 1] = f.y, l[j][e] = x0 - f.x, l[j][e + 1] = x1 - f.y;
    }
  wg::store_t_sw128<NT>(hi, rows, r0, c0, h, lane);
  wg::store_t_sw128<NT>(hi + lo_off, rows, r0, c0, l, lane);
}

// d += A^T B over a k-step, A MN-major, B K-major, N = 8 NT (32 or 64).
template <int NT>
__device__ __forceinline__ void mma_ta(float (&d)[NT][4], uint64_t a, uint64_t b) {
  if constexpr (NT == 4) wg::mma_bf16_n32<1, 0>(d, a, b);
  else wg::mma_bf16_n64<1, 0>(d, a, b);
}

template <int K, int VS, bool GRAD>
__device__ __forceinline__ void scan_wg(const Params& bp, unsigned char* sb, const chunk::SliceTask& tk) {
  using Ty = ScanTiles<K, VS>;
  using F = Fac<K>;
  constexpr int NS = VS / 8, NH = VS / 16;  // n-tiles: the carried slice, a warpgroup's half of P1
  constexpr int first = GRAD ? F::R : F::W, second = GRAD ? F::W : F::R;
  const FwdParams& p = bp.f;
  const uint32_t base = mma::smem_addr(sb);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wgi = warp / 4, w4 = warp & 3;
  const int g = lane >> 2, q2 = (lane & 3) * 2;
  const int hv = tk.hv, v0 = tk.v0, nch = tk.nchunks;
  const int64_t tok_ld = static_cast<int64_t>(p.HV) * p.V, KV = static_cast<int64_t>(K) * p.V;
  const bool owns = K > 64 || wgi == 0;  // rows r0 and r0 + 8 of the carried matrix (known at compile time at K = 128)
  const int r0 = 64 * wgi + 16 * w4 + g, n1 = wgi * (VS / 2);  // n1: the warpgroup's columns of P1
  auto fac_of = [&](int ci) { return bp.fac + ((tk.cbase + ci) * p.HV + hv) * F::size; };
  auto chunk_of = [&](int k) { return GRAD ? nch - 1 - k : k; };
  auto slot_of = [&](int ci) { return (GRAD ? bp.dS : bp.S0) + ((tk.cbase + ci) * p.HV + hv) * KV + v0; };
  auto addend_of = [&](const ChunkAt& ch) { return (GRAD ? bp.X : bp.U) + ch.f0 * tok_ld + hv * p.V + v0 + n1; };
  // step k's inputs from global memory, a step ahead: P1's addend (U or X; rows past the chunk zero),
  // e^{G_C} of this thread's rows, and Y (the gradients; read before step k writes dS_end over it)
  float dn[NH][4], egn[2] = {0.0f, 0.0f}, yn[NS][4] = {};
  auto inputs_of = [&](int k) {
    const int ci = chunk_of(k);
    const ChunkAt ch = chunk_in(p, tk.sq, ci);
    const float* addend = addend_of(ch);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = 16 * w4 + g + 8 * hr;
#pragma unroll
      for (int j = 0; j < NH; ++j) {
        const float2 x = t < ch.Lc ? *reinterpret_cast<const float2*>(addend + t * tok_ld + 8 * j + q2) : make_float2(0.0f, 0.0f);
        dn[j][2 * hr] = x.x, dn[j][2 * hr + 1] = x.y;
      }
    }
    if (owns) {
      const float* fc = fac_of(ci);
      egn[0] = fc[F::EG + r0], egn[1] = fc[F::EG + r0 + 8];
      if (GRAD) {
        const float* slot = slot_of(ci);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int j = 0; j < NS; ++j) {
            const float2 x = *reinterpret_cast<const float2*>(slot + static_cast<int64_t>(r0 + 8 * hr) * p.V + 8 * j + q2);
            yn[j][2 * hr] = x.x, yn[j][2 * hr + 1] = x.y;
          }
      }
    }
  };

  float s[NS][4];  // the initial state, or the final state's gradient (zeros without one)
  {
    const void* src = GRAD ? bp.io.dht : p.h0;
    const int dt = GRAD ? bp.io.dht_dt : p.h0_dt;
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[j][e] = src && owns ? ld(src, dt, state_elem(p, tk.n, hv, v0 + 8 * j + q2 + (e & 1), r0 + 8 * (e >> 1))) : 0.0f;
  }
  // ra: a chunk's first left operand, loaded at B2 a step before it is staged at B2; rb: its second, B3 to B3
  RowsInFlight<K> ra, rb;
  if (nch > 0) {
    ra.load(fac_of(chunk_of(0)) + first), rb.load(fac_of(chunk_of(0)) + second);
    ra.put(sb + Ty::A), rb.put(sb + Ty::B);
    inputs_of(0);
  }
  if (nch > 1) ra.load(fac_of(chunk_of(1)) + first), rb.load(fac_of(chunk_of(1)) + second);
  for (int k = 0; k < nch; ++k) {
    const int ci = chunk_of(k);
    const ChunkAt ch = chunk_in(p, tk.sq, ci);
    float* slot = slot_of(ci);
    float* addend = addend_of(ch);
    float d[NH][4], eg[2] = {egn[0], egn[1]}, y[NS][4];
#pragma unroll
    for (int j = 0; j < NH; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) d[j][e] = dn[j][e];
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] = yn[j][e];
    if (k + 1 < nch) inputs_of(k + 1);
    if (owns) store_t_hilo<NS>(base + Ty::S, Ty::kS, VS, 64 * wgi + 16 * w4, 0, s, GRAD ? 1.0f : -1.0f, lane);
    wg::fence_proxy_async();
    __syncthreads();  // B1: the carried matrix^T and the step's left operands in
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      const uint64_t ah = wg::desc_kstep(base + Ty::A, C, 0, kk), al = wg::desc_kstep(base + Ty::A + Ty::kM, C, 0, kk);
      const uint64_t bh = wg::desc_kstep(base + Ty::S, VS, n1, kk), bl = wg::desc_kstep(base + Ty::S + Ty::kS, VS, n1, kk);
      wg::mma_bf16<NH>(d, ah, bh);
      wg::mma_bf16<NH>(d, ah, bl);
      wg::mma_bf16<NH>(d, al, bh);
    }
    wg::commit();
    if (owns)  // while P1 runs: the carried matrix out (the chunk's start state, or its end state's gradient)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int j = 0; j < NS; ++j)
          *reinterpret_cast<float2*>(slot + static_cast<int64_t>(r0 + 8 * hr) * p.V + 8 * j + q2) =
              make_float2(s[j][2 * hr], s[j][2 * hr + 1]);
    wg::wait_all();
    wg::fence_operand(d);
    if (GRAD) {  // dDelta over X's rows
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = 16 * w4 + g + 8 * hr;
        if (t < ch.Lc)
#pragma unroll
          for (int j = 0; j < NH; ++j)
            *reinterpret_cast<float2*>(addend + t * tok_ld + 8 * j + q2) = make_float2(d[j][2 * hr], d[j][2 * hr + 1]);
      }
    }
    store_t_hilo<NH>(base + Ty::D, Ty::kD, VS, 16 * w4, n1, d, GRAD ? -1.0f : 1.0f, lane);
    wg::fence_proxy_async();
    __syncthreads();  // B2: the first result^T in; tile A read
    if (k + 1 < nch) ra.put(sb + Ty::A);
    if (k + 2 < nch) ra.load(fac_of(chunk_of(k + 2)) + first);
    if (owns) {
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = eg[e >> 1] * s[j][e] + y[j][e];
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
        const uint64_t ah = wg::desc_mn(base + Ty::B, C, kk, 64 * wgi), al = wg::desc_mn(base + Ty::B + Ty::kM, C, kk, 64 * wgi);
        const uint64_t bh = wg::desc_kstep(base + Ty::D, VS, 0, kk), bl = wg::desc_kstep(base + Ty::D + Ty::kD, VS, 0, kk);
        mma_ta<NS>(s, ah, bh);
        mma_ta<NS>(s, ah, bl);
        mma_ta<NS>(s, al, bh);
      }
      wg::commit();
      wg::wait_all();
      wg::fence_operand(s);
    }
    __syncthreads();  // B3: tile B and the first result^T read
    if (k + 1 < nch) rb.put(sb + Ty::B);
    if (k + 2 < nch) rb.load(fac_of(chunk_of(k + 2)) + second);
  }
  if (GRAD && bp.io.dh0 && owns)
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        st(bp.io.dh0, bp.io.dh0_dt, state_elem(p, tk.n, hv, v0 + 8 * j + q2 + (e & 1), r0 + 8 * (e >> 1)), s[j][e]);
}

template <int K, bool DELTA, int VS, int PREC>
__global__ void __launch_bounds__(ST, wg_scan<K, DELTA, VS>() ? 1 : 2) state_scans_kernel(const Params bp) {
  extern __shared__ __align__(1024) float sm[];  // (the wgmma tiles' swizzle repeats every 1024 bytes)
  const chunk::SliceTask tk = chunk::slice_task<VS>(bp.f, bp.chunk_base, blockIdx.x >> 1);
  if constexpr (CULA_WGMMA && wg_scan<K, DELTA, VS>()) {
    if (blockIdx.x & 1) scan_wg<K, VS, true>(bp, reinterpret_cast<unsigned char*>(sm), tk);
    else scan_wg<K, VS, false>(bp, reinterpret_cast<unsigned char*>(sm), tk);
    return;
  }
  if (blockIdx.x & 1) state_grad_scan<K, DELTA, VS, PREC>(bp, sm, tk);
  else state_scan<K, DELTA, VS, PREC>(bp, sm, tk);
}

// ---- 5. value side (delta rule) ----------------------------------------------------------------
// beta R, the second product's operand, is read through a row-scaled view of R, not stored; where
// S0's slice holds two C x VE tiles (K >= 2C), dDelta and dB take its place once the first product
// has read it, so that K = 128 fits two CTAs per SM (107 KB).
template <int K>
struct ValueLayout {
  static constexpr int LK = K + 4, LV = VE + 8, LT = C + 4;
  static constexpr int kS0 = K * LV;
  static constexpr bool kAlias = kS0 >= 2 * C * LV;
  static constexpr int Kg = 0, S0 = Kg + C * LK, T = S0 + kS0, R = T + C * LT, dD = kAlias ? S0 : R + C * LV,
                       dB = dD + C * LV, beta = kAlias ? R + C * LV : dB + C * LV, floats = beta + C;
  static constexpr int bytes = floats * 4;
};

// sm_90a: the products' operands as bf16 hi / lo tiles in the 128-byte swizzle (bytes): -Kg (C x K)
// and S0^T (VE x K) for the first product; T and T^T (C x C); once the first product has read its
// tiles, (beta R)^T and dDelta^T (VE x C) in their place; then beta and each warpgroup's part of
// beta's sums.
template <int K>
struct ValueTiles {
  static constexpr int kKg = C * K * 2, kS0t = VE * K * 2, kT = C * C * 2, kV = VE * C * 2;
  static constexpr int Kg = 0, S0t = 2 * kKg, T = S0t + 2 * kS0t, Tt = T + 2 * kT, bRt = 0, dDt = 2 * kV,
                       beta = Tt + 2 * kT, dbeta = beta + C * 4, bytes = dbeta + 4 * C * 4;
  static_assert(4 * kV <= T, "(beta R)^T and dDelta^T overlap T");
  static_assert(bytes <= ValueLayout<K>::bytes, "the tiles take more than the launch's shared memory");
};

// The value kernel's products on warpgroups (sm_90a): four warpgroups, each 16 of the 64 columns.
// First product: the accumulators start at v and take -Kg S0 (R = v - Kg S0); then Delta = T (beta R)
// and dB = T^T dDelta side by side. Each operand is split into bf16 hi / lo once, as it is staged
// (hi hi' + hi lo' + lo hi' a k-step).
template <int K>
__device__ __forceinline__ void value_products_wg(unsigned char* sb, const Params& bp, const ChunkAt& ch, const float* fac,
                                                  const float* S0g, int hv, int h, int v0) {
  using Ty = ValueTiles<K>;
  using F = Fac<K>;
  const uint32_t base = mma::smem_addr(sb);
  float* bet = reinterpret_cast<float*>(sb + Ty::beta);
  float* dbp = reinterpret_cast<float*>(sb + Ty::dbeta);
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, Lc = ch.Lc;
  const int wgi = warp / 4, w4 = warp & 3, g = lane >> 2, q2 = (lane & 3) * 2, n0 = 16 * wgi;
  const int64_t tok_ld = static_cast<int64_t>(p.HV) * p.V;
  const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

  // -Kg (rows: tokens), S0^T (rows: columns of V), T and T^T, beta
#pragma unroll 2
  for (int i = tid; i < C * K / 4; i += NT) {
    const int t = i / (K / 4), c = (i % (K / 4)) * 4;
    float4 x = z;
    if (t < Lc) {
      const float4 k4 = *reinterpret_cast<const float4*>(bp.x.kh + ((ch.f0 + t) * p.H + h) * K + c);
      const float4 g4 = *reinterpret_cast<const float4*>(fac + F::G + t * K + c);
      x = make_float4(-k4.x * fast_exp(g4.x), -k4.y * fast_exp(g4.y), -k4.z * fast_exp(g4.z), -k4.w * fast_exp(g4.w));
    }
    put_rows(sb + Ty::Kg, Ty::kKg, C, t, c, x);
  }
#pragma unroll 2
  for (int i = tid; i < K / 2 * (VE / 4); i += NT) {
    const int k = (i / (VE / 4)) * 2, v = (i % (VE / 4)) * 4;
    const float4 a = *reinterpret_cast<const float4*>(S0g + static_cast<int64_t>(k) * p.V + v0 + v);
    const float4 b = *reinterpret_cast<const float4*>(S0g + static_cast<int64_t>(k + 1) * p.V + v0 + v);
    put_pairs_t(sb + Ty::S0t, Ty::kS0t, VE, k, v, a, b);
  }
  for (int i = tid; i < C / 2 * (C / 4); i += NT) {
    const int t = (i / (C / 4)) * 2, c = (i % (C / 4)) * 4;
    const float4 a = *reinterpret_cast<const float4*>(fac + F::T + t * C + c);
    const float4 b = *reinterpret_cast<const float4*>(fac + F::T + (t + 1) * C + c);
    put_rows(sb + Ty::T, Ty::kT, C, t, c, a);
    put_rows(sb + Ty::T, Ty::kT, C, t + 1, c, b);
    put_pairs_t(sb + Ty::Tt, Ty::kT, C, t, c, a, b);
  }
  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  // the first product's accumulators start at v (rows past the chunk zero)
  float acc[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = 16 * w4 + g + 8 * (e >> 1), c = n0 + 8 * j + q2 + (e & 1);
      acc[j][e] = t < Lc ? ld(p.v, p.v_dt, ch.b_row * p.v_s[0] + (ch.t0 + t) * p.v_s[1] + hv * p.v_s[2] + v0 + c) : 0.0f;
    }
  wg::fence_proxy_async();
  __syncthreads();
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint64_t ah = wg::desc_kstep(base + Ty::Kg, C, 0, kk), al = wg::desc_kstep(base + Ty::Kg + Ty::kKg, C, 0, kk);
    const uint64_t bh = wg::desc_kstep(base + Ty::S0t, VE, n0, kk),
                   bl = wg::desc_kstep(base + Ty::S0t + Ty::kS0t, VE, n0, kk);
    wg::mma_bf16<2>(acc, ah, bh);
    wg::mma_bf16<2>(acc, ah, bl);
    wg::mma_bf16<2>(acc, al, bh);
  }
  wg::commit();
  wg::wait_all();
  wg::fence_operand(acc);  // acc = R
  __syncthreads();         // -Kg and S0^T read: (beta R)^T and dDelta^T take their place
  {
    float hi[2][4], lo[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) hilo(bet[16 * w4 + g + 8 * (e >> 1)] * acc[j][e], hi[j][e], lo[j][e]);
    wg::store_t_sw128<2>(base + Ty::bRt, VE, 16 * w4, n0, hi, lane);
    wg::store_t_sw128<2>(base + Ty::bRt + Ty::kV, VE, 16 * w4, n0, lo, lane);
  }
  for (int i = tid; i < C / 2 * (VE / 4); i += NT) {
    const int t = (i / (VE / 4)) * 2, v = (i % (VE / 4)) * 4;
    const float* src = bp.dDelta + (ch.f0 + t) * tok_ld + hv * p.V + v0 + v;
    const float4 a = t < Lc ? *reinterpret_cast<const float4*>(src) : z;
    const float4 b = t + 1 < Lc ? *reinterpret_cast<const float4*>(src + tok_ld) : z;
    put_pairs_t(sb + Ty::dDt, Ty::kV, VE, t, v, a, b);
  }
  wg::fence_proxy_async();
  __syncthreads();
  float dl[2][4] = {}, db[2][4] = {};
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {
    const uint64_t th = wg::desc_kstep(base + Ty::T, C, 0, kk), tl = wg::desc_kstep(base + Ty::T + Ty::kT, C, 0, kk);
    const uint64_t uh = wg::desc_kstep(base + Ty::Tt, C, 0, kk), ul = wg::desc_kstep(base + Ty::Tt + Ty::kT, C, 0, kk);
    const uint64_t rh = wg::desc_kstep(base + Ty::bRt, VE, n0, kk), rl = wg::desc_kstep(base + Ty::bRt + Ty::kV, VE, n0, kk);
    const uint64_t dh = wg::desc_kstep(base + Ty::dDt, VE, n0, kk), dlo = wg::desc_kstep(base + Ty::dDt + Ty::kV, VE, n0, kk);
    wg::mma_bf16<2>(dl, th, rh);
    wg::mma_bf16<2>(dl, th, rl);
    wg::mma_bf16<2>(dl, tl, rh);
    wg::mma_bf16<2>(db, uh, dh);
    wg::mma_bf16<2>(db, uh, dlo);
    wg::mma_bf16<2>(db, ul, dh);
  }
  wg::commit();
  wg::wait_all();
  wg::fence_operand(dl), wg::fence_operand(db);
  // Delta, dB, dv = beta dB, and this warpgroup's part of beta's sums dB . R
  float part[2] = {0.0f, 0.0f};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = 16 * w4 + g + 8 * hr;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = n0 + 8 * j + q2;
      part[hr] += db[j][2 * hr] * acc[j][2 * hr] + db[j][2 * hr + 1] * acc[j][2 * hr + 1];
      if (t < Lc) {
        const int64_t o = (ch.f0 + t) * tok_ld + hv * p.V + v0 + c;
        *reinterpret_cast<float2*>(bp.Delta + o) = make_float2(dl[j][2 * hr], dl[j][2 * hr + 1]);
        *reinterpret_cast<float2*>(bp.dB + o) = make_float2(db[j][2 * hr], db[j][2 * hr + 1]);
        if (bp.io.dv) {
          const int64_t d = ch.b_row * bp.io.dv_s[0] + (ch.t0 + t) * bp.io.dv_s[1] + hv * bp.io.dv_s[2];
          st(bp.io.dv, bp.io.dv_dt, d + (v0 + c) * bp.io.dv_s[3], bet[t] * db[j][2 * hr]);
          st(bp.io.dv, bp.io.dv_dt, d + (v0 + c + 1) * bp.io.dv_s[3], bet[t] * db[j][2 * hr + 1]);
        }
      }
    }
    part[hr] += __shfl_xor_sync(0xffffffffu, part[hr], 1);
    part[hr] += __shfl_xor_sync(0xffffffffu, part[hr], 2);
    if ((lane & 3) == 0) dbp[wgi * C + t] = part[hr];
  }
  __syncthreads();
  if (tid < Lc)
    bp.dbeta_part[((v0 / VE) * bp.BT + ch.f0 + tid) * p.HV + hv] =
        ((dbp[tid] + dbp[C + tid]) + dbp[2 * C + tid]) + dbp[3 * C + tid];
}

template <int K, int PREC>
__global__ void __launch_bounds__(NT, 2) value_grad_kernel(const Params bp) {
  using Ly = ValueLayout<K>;
  using F = Fac<K>;
  constexpr int LK = Ly::LK, LV = Ly::LV, LT = Ly::LT;
  extern __shared__ __align__(1024) float sm[];  // (the bf16 tiles' swizzle repeats every 1024 bytes)
  float *Kg = sm + Ly::Kg, *S0 = sm + Ly::S0, *Tm = sm + Ly::T, *R = sm + Ly::R, *dBs = sm + Ly::dB, *dD = sm + Ly::dD;
  float* bet = sm + Ly::beta;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const ChunkSlice cs = chunk_slice(p, p.V / VE, VE);
  const int cidx = cs.cidx, hv = cs.hv, v0 = cs.col0;
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!chunk_at(bp, cidx, ch)) return;
  const float* fac = bp.fac + (static_cast<int64_t>(cidx) * p.HV + hv) * F::size;
  const int Lc = ch.Lc;
  const float* S0g = bp.S0 + (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V;

  if constexpr (CULA_WGMMA) {
    value_products_wg<K>(reinterpret_cast<unsigned char*>(sm), bp, ch, fac, S0g, hv, h, v0);
    return;
  }
  rows_async<C, C>(Tm, LT, fac + F::T, C);
  rows_async<K, VE>(S0, LV, S0g + v0, p.V);
  auto load_dDelta = [&] {
    rows_async<C, VE>(dD, LV, bp.dDelta + ch.f0 * p.HV * p.V + hv * p.V + v0, static_cast<int64_t>(p.HV) * p.V, Lc);
  };
  if (!Ly::kAlias) load_dDelta();
  mma::cp_async_commit();
  input_rows<C, VE>(R, LV, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0, p.v_s[1], Lc);
#pragma unroll 8
  for (int i = tid; i < C * K; i += NT) {
    const int t = i / K, c = i % K;
    Kg[t * LK + c] = t < Lc ? bp.x.kh[((ch.f0 + t) * p.H + h) * K + c] * fast_exp(fac[F::G + i]) : 0.0f;
  }
  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  mma::cp_async_wait_all();
  __syncthreads();
  tf32::gemm<C, VE, K, NW, 2, PREC>(rows(Kg, LK), rows(S0, LV), [&](int i, int j, float v) { R[i * LV + j] -= v; });
  __syncthreads();  // S0 read (dDelta may take its place), R formed
  if (Ly::kAlias) load_dDelta(), mma::cp_async_commit();  // lands while the second product runs
  tf32::gemm<C, VE, C, NW, 2, PREC>(rows(Tm, LT), RowScaled{R, LV, bet}, [&](int i, int j, float v) {
    if (i < Lc) bp.Delta[((ch.f0 + i) * p.HV + hv) * p.V + v0 + j] = v;
  });
  mma::cp_async_wait_all();
  __syncthreads();  // dDelta in
  tf32::gemm<C, VE, C, NW, 2, PREC>(cols(Tm, LT), rows(dD, LV), [&](int i, int j, float v) { dBs[i * LV + j] = v; });
  __syncthreads();
  for (int i = tid; i < Lc * VE; i += NT) {
    const int t = i / VE, j = i % VE;
    const float db = dBs[t * LV + j];
    bp.dB[((ch.f0 + t) * p.HV + hv) * p.V + v0 + j] = db;
    if (bp.io.dv)
      st(bp.io.dv, bp.io.dv_dt, ch.b_row * bp.io.dv_s[0] + (ch.t0 + t) * bp.io.dv_s[1] + hv * bp.io.dv_s[2] + (v0 + j) * bp.io.dv_s[3], bet[t] * db);
  }
  for (int t = warp; t < Lc; t += NW) {
    float s = dBs[t * LV + lane] * R[t * LV + lane] + dBs[t * LV + lane + 32] * R[t * LV + lane + 32];
    s = dev::warp_sum(s);
    if (lane == 0) bp.dbeta_part[((v0 / VE) * bp.BT + ch.f0 + t) * p.HV + hv] = s;
  }
}

// ---- 6. key side -------------------------------------------------------------------------------
struct KeyLayout {
  static constexpr int L = VE + 4;
  static constexpr int dO = 0, dB = dO + C * L, D = dB + C * L, S0 = D + C * L, dS = S0 + VE * L, rs = dS + VE * L,
                       nbeta = rs + VE, floats = nbeta + C;
  static constexpr int bytes = floats * 4;
  // sm_90a with the delta rule: the products' operands as bf16 hi / lo tiles (64 x 64, the 128-byte
  // swizzle, 8 KB each) in the bytes below rs, in this order: dO, -beta dB, Delta, S0, dS
  static constexpr int kTile = C * VE * 2, kTiles = 10;
  static_assert(kTiles * kTile <= rs * 4, "the bf16 tiles overlap rs");
};

// Two CTAs per SM, so that one CTA's loads of a column slice wait while the other's products run.
// With the delta rule (three accumulated products) eight warps at up to 128 registers: 16-20% off
// the kernel against one 16-warp CTA of 92 registers (H200). Without it (two products) sixteen warps
// fit in 64 registers: eight warps measured 22% slower there.
template <bool DELTA>
struct KeyShape {
  static constexpr int warps = DELTA ? 8 : NW, threads = 32 * warps, ctas = 2;
};
template <int K, bool DELTA, int PREC>
__global__ void __launch_bounds__(KeyShape<DELTA>::threads, KeyShape<DELTA>::ctas) key_grad_kernel(const Params bp) {
  constexpr int KW = KeyShape<DELTA>::warps, KT = KeyShape<DELTA>::threads;
  using Ly = KeyLayout;
  using F = Fac<K>;
  constexpr int L = Ly::L;
  constexpr int64_t PW = bwd::part_width(K);
  extern __shared__ __align__(1024) float sm[];  // (the bf16 tiles' swizzle repeats every 1024 bytes)
  float *dO = sm + Ly::dO, *dB = sm + Ly::dB, *Dl = sm + Ly::D, *S0 = sm + Ly::S0, *dSs = sm + Ly::dS;
  float *rs = sm + Ly::rs, *nbet = sm + Ly::nbeta;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const ChunkSlice cs = chunk_slice(p, K / VE, VE);
  const int cidx = cs.cidx, hv = cs.hv, c0 = cs.col0;
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!chunk_at(bp, cidx, ch)) return;
  const float* fac = bp.fac + (static_cast<int64_t>(cidx) * p.HV + hv) * F::size;
  const int Lc = ch.Lc;
  const int64_t blk = (static_cast<int64_t>(cidx) * p.HV + hv) * K * p.V;
  const int64_t tok = ch.f0 * p.HV * p.V + hv * p.V, tok_ld = static_cast<int64_t>(p.HV) * p.V;

  if (tid < VE) rs[tid] = 0.0f;
  if (tid < C) nbet[tid] = tid < Lc ? -bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  float *sQ = dO, *sK = dB, *sR = Dl;  // the sums, drained to shared memory
  if constexpr (CULA_WGMMA && DELTA) {
    // Warpgroup products on bf16 hi / lo tiles, each operand split once as it is staged (three
    // products a k-step: hi hi' + hi lo' + lo hi', about 3xTF32's precision). Warpgroup w takes the
    // channels [32 w, 32 w + 32). (Without the delta rule, sixteen warps held at 64 registers, the
    // mma.sync path measured 7% faster: H200, GLA 1x8192 H32.)
    constexpr int NWG = KW / 4, NTL = 8 / NWG;  // warpgroups, n-tiles of 8 channels each
    const int wgi = warp / 4, n0 = wgi * (VE / NWG);
    unsigned char* tiles = reinterpret_cast<unsigned char*>(sm);
    const uint32_t tbase = mma::smem_addr(tiles);
    enum { tdO = 0, tA = 2, tD = 4, tS0 = 6, tdS = 8 };  // hi at 2i, lo at 2i + 1
    auto put = [&](int tile, int r, int c, float4 x) { put_rows(tiles + tile * Ly::kTile, Ly::kTile, C, r, c, x); };
    constexpr int PER = C * VE / 4 / KT;  // float4s of a 64 x 64 tile per thread
    float aQ[NTL][4] = {}, aK[NTL][4] = {}, aR[NTL][4] = {};
    for (int v0 = 0; v0 < p.V; v0 += VE) {
      __syncthreads();  // the slice before is read
      {  // S0 and dS (rows: channels), and this thread's part of their channel sums S0 . dS
        float4 a[PER], b[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
          const int i = tid + u * KT, r = i >> 4, c = (i & 15) * 4;
          const int64_t o = blk + static_cast<int64_t>(c0 + r) * p.V + v0 + c;
          a[u] = *reinterpret_cast<const float4*>(bp.S0 + o);
          b[u] = *reinterpret_cast<const float4*>(bp.dS + o);
        }
#pragma unroll
        for (int u = 0; u < PER; ++u) {
          const int i = tid + u * KT, r = i >> 4, c = (i & 15) * 4;
          put(tS0, r, c, a[u]);
          put(tdS, r, c, b[u]);
          float x = a[u].x * b[u].x + a[u].y * b[u].y + a[u].z * b[u].z + a[u].w * b[u].w;
#pragma unroll
          for (int m = 8; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);  // the row's 16 lanes
          if ((tid & 15) == 0) rs[r] += x;  // (row r's one owner in every slice)
        }
      }
      // dO, -beta dB and Delta; rows: tokens, zeros past the chunk. One
      // operand at a time (a thread's loads of it issued together), so the accumulators stay in
      // registers.
      const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      auto token_rows = [&](int tile, auto&& at) {
        float4 x[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
          const int i = tid + u * KT, t = i >> 4, c = (i & 15) * 4;
          x[u] = t < Lc ? at(t, c) : z;
        }
#pragma unroll
        for (int u = 0; u < PER; ++u) {
          const int i = tid + u * KT;
          put(tile, i >> 4, (i & 15) * 4, x[u]);
        }
      };
      token_rows(tdO, [&](int t, int c) {
        return load4(bp.io.dO, bp.io.dO_dt,
                     ch.b_row * bp.io.dO_s[0] + (ch.t0 + t) * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0 + c);
      });
      token_rows(tA, [&](int t, int c) {
        const float4 d = *reinterpret_cast<const float4*>(bp.dB + tok + t * tok_ld + v0 + c);
        const float nb = nbet[t];
        return make_float4(nb * d.x, nb * d.y, nb * d.z, nb * d.w);
      });
      token_rows(tD, [&](int t, int c) { return *reinterpret_cast<const float4*>(bp.Delta + tok + t * tok_ld + v0 + c); });
      wg::fence_proxy_async();
      __syncthreads();
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < VE / 16; ++kk) {
        auto a = [&](int t) { return wg::desc_kstep(tbase + t * Ly::kTile, C, 0, kk); };
        auto b = [&](int t) { return wg::desc_kstep(tbase + t * Ly::kTile, VE, n0, kk); };
        // (all three products also where an input's lo tile is zero: a branch between them makes the
        // compiler fence the accumulators around every product)
        wg::mma_bf16<NTL>(aQ, a(tdO), b(tS0));
        wg::mma_bf16<NTL>(aQ, a(tdO), b(tS0 + 1));
        wg::mma_bf16<NTL>(aQ, a(tdO + 1), b(tS0));
        wg::mma_bf16<NTL>(aK, a(tA), b(tS0));
        wg::mma_bf16<NTL>(aK, a(tA), b(tS0 + 1));
        wg::mma_bf16<NTL>(aK, a(tA + 1), b(tS0));
        wg::mma_bf16<NTL>(aR, a(tD), b(tdS));
        wg::mma_bf16<NTL>(aR, a(tD), b(tdS + 1));
        wg::mma_bf16<NTL>(aR, a(tD + 1), b(tdS));
      }
      wg::commit();
      wg::wait_all();
      wg::fence_operand(aQ), wg::fence_operand(aK), wg::fence_operand(aR);
    }
    __syncthreads();  // every warpgroup's products done: the tiles take the sums
    const int w4 = warp & 3, g = lane >> 2, q2 = (lane & 3) * 2;
    auto drain = [&](float* dst, const float (&d)[NTL][4]) {
#pragma unroll
      for (int j = 0; j < NTL; ++j) {
        const int r = 16 * w4 + g, c = n0 + 8 * j + q2;
        dst[r * L + c] = d[j][0], dst[r * L + c + 1] = d[j][1];
        dst[(r + 8) * L + c] = d[j][2], dst[(r + 8) * L + c + 1] = d[j][3];
      }
    };
    drain(sQ, aQ);
    drain(sK, aK);
    drain(sR, aR);
  } else {
    tf32::Acc<C, VE, KW> aQ, aK, aR;  // dQg, dKg, dKr over V
    aQ.zero(), aK.zero(), aR.zero();
    for (int v0 = 0; v0 < p.V; v0 += VE) {
      __syncthreads();  // the slice before is done
      if (DELTA) {
        rows_async<C, VE, KT>(dB, L, bp.dB + tok + v0, tok_ld, Lc);
        rows_async<C, VE, KT>(Dl, L, bp.Delta + tok + v0, tok_ld, Lc);
      }
      rows_async<VE, VE, KT>(S0, L, bp.S0 + blk + static_cast<int64_t>(c0) * p.V + v0, p.V);
      rows_async<VE, VE, KT>(dSs, L, bp.dS + blk + static_cast<int64_t>(c0) * p.V + v0, p.V);
      mma::cp_async_commit();
      input_rows<C, VE, KT>(dO, L, bp.io.dO, bp.io.dO_dt, ch.b_row * bp.io.dO_s[0] + ch.t0 * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0, bp.io.dO_s[1], Lc);
      if (!DELTA) input_rows<C, VE, KT>(Dl, L, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0, p.v_s[1], Lc);
      mma::cp_async_wait_all();
      __syncthreads();
      aQ.template add<VE, PREC>(rows(dO, L), cols(S0, L));
      if (DELTA) aK.template add<VE, PREC>(RowScaled{dB, L, nbet}, cols(S0, L));
      aR.template add<VE, PREC>(rows(Dl, L), cols(dSs, L));
      for (int c = warp; c < VE; c += KW) {  // sum over the slice's columns of S0 . dS, per channel
        float s = 0.0f;
        for (int j = lane; j < VE; j += 32) s += S0[c * L + j] * dSs[c * L + j];
        s = dev::warp_sum(s);
        if (lane == 0) rs[c] += s;
      }
    }
    __syncthreads();
    aQ.drain([&](int i, int j, float v) { sQ[i * L + j] = v; });
    aK.drain([&](int i, int j, float v) { sK[i * L + j] = v; });
    aR.drain([&](int i, int j, float v) { sR[i * L + j] = v; });
  }
  __syncthreads();
  for (int i = tid; i < Lc * VE; i += KT) {
    const int t = i / VE, c = i % VE;
    const int64_t f = ch.f0 + t;
    const float G = fac[F::G + t * K + c0 + c], e = fast_exp(G), er = fast_exp(fac[F::G + (C - 1) * K + c0 + c] - G);
    const float q = bp.x.qh[(f * p.H + h) * K + c0 + c], k = bp.x.kh[(f * p.H + h) * K + c0 + c];
    const float dq = e * sQ[t * L + c], dkg = DELTA ? e * sK[t * L + c] : 0.0f, dkr = er * sR[t * L + c];
    float* pr = bp.part + (f * p.HV + hv) * PW;
    pr[c0 + c] = dq;
    pr[K + c0 + c] = dkg + dkr;
    pr[2 * K + c0 + c] = q * dq + k * dkg - k * dkr;
    sR[t * L + c] = k * dkr;  // Kr . dKr, summed over the tokens below
  }
  __syncthreads();
  // G_C = G of the chunk's last token: its terms go to the last valid row (the reverse cumulative
  // sum of the pair kernel adds them to every token of the chunk)
  for (int c = tid; c < VE; c += KT) {
    float s = fac[F::EG + c0 + c] * rs[c];
    for (int t = 0; t < Lc; ++t) s += sR[t * L + c];
    bp.part[((ch.f0 + Lc - 1) * p.HV + hv) * PW + 2 * K + c0 + c] += s;
  }
}

// ---- 7. pair side ------------------------------------------------------------------------------
// One CTA per (chunk, value head): dP and dA are formed over V once; the pair terms are then per
// channel, so the CTA takes the channels in halves of PC, keeping a half's dq^ and dk^ terms in
// shared memory (aq, ak) from the key kernel's partial rows to one write back, instead of adding
// to the part rows in global memory pass after pass.
constexpr int PC = 64;  // channels per pass of the pair kernel
template <int K>
struct PairLayout {
  static constexpr int L = VE + 4, LC = C + 8, LK = PC + 4, LS = PC + 8;
  static constexpr int SC = tf32::wide_scratch<16, PC, 16, NW>();  // the block products' split (gemm_wide)
  static constexpr int dP = 0, dA = dP + C * LC, q = dA + C * LC, k = q + C * LK, G = k + C * LK, dG = G + C * LK,
                       aq = dG + C * LK, ak = aq + C * LK, S = ak + C * LK, beta = S + 48 * LS, g = beta + C, sc = g + C,
                       floats = sc + 2 * SC;
  static constexpr int dO = q, dB = dO + C * L, D = dB + C * L;  // phase 1, in the q .. G region
  // (dG, aq and ak take the first channel half's part rows meanwhile)
  static_assert(D + C * L <= dG, "the products over V fit where q, k and G go");
  // one product over [dP; w] and [q^; k^] (the scalar-decay path): each pair adjacent
  static_assert(dA == dP + C * LC && k == q + C * LK, "stacked operands");
  static constexpr int bytes = floats * 4;
};

// The pair kernel's shared state for its block passes (channels c0 .. c0 + PC of the chunk).
template <int K>
struct PairCtx {
  const float *dP, *w, *qs, *ks, *Gs;
  float *dGs, *aq, *ak, *S, *sc0, *sc1;
  int Lc;
};

// The diagonal block at tokens b .. b + 15, channel c, rows t = 2 m + H of it: every pair (t, s <= t)
// once, its factor e^{G_t - G_s} serving both the row sums (dq^_t += sum_s dP_ts e k^_s, dk^_t +=
// sum_s w_ts e k^_s, added here: each row has one owner) and the column sums (dk^_s += sum_t e (dP_ts
// q^_t + w_ts k^_t), returned in col: the two parities' threads add them in turn).
template <int K, bool DELTA, int H>
__device__ __forceinline__ void pair_diag_rows(const float* dP, const float* w, const float* qs, const float* ks,
                                               const float* Gs, float* aq, float* ak, float* dGs, int c, int b,
                                               float (&col)[16]) {
  using Ly = PairLayout<K>;
  constexpr int LC = Ly::LC, LK = Ly::LK;
  float G[16], kk[16], qq[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    G[j] = Gs[(b + j) * LK + c], kk[j] = ks[(b + j) * LK + c], qq[j] = qs[(b + j) * LK + c];
    col[j] = 0.0f;
  }
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int t = 2 * m + H;
    const float *dpr = dP + (b + t) * LC + b, *wr = w + (b + t) * LC + b;
    float aqs = 0.0f, aks = 0.0f;
#pragma unroll
    for (int u = 0; u <= t; ++u) {
      const float e = fast_exp(G[t] - G[u]), dp = dpr[u], x = e * kk[u];
      aqs += dp * x;
      float cs = dp * qq[t];
      if (DELTA) {
        const float wv = wr[u];
        aks += wv * x;
        cs += wv * kk[t];
      }
      col[u] += e * cs;
    }
    const int r = (b + t) * LK + c;
    aq[r] += aqs;
    if (DELTA) ak[r] += aks;
    dGs[r] += qq[t] * aqs + kk[t] * aks;
  }
}

// Rows of block I (I >= 1) from the tokens before it, on tensor cores: through r = 16 I - 1,
// dq_t += e^{G_t - G_r} sum_s dP_ts (k_s e^{G_r - G_s}), the same with w for dk_t.
template <int K, bool DELTA, int I, int PREC>
__device__ __forceinline__ void pair_block_rows(const PairCtx<K>& x) {
  using Ly = PairLayout<K>;
  constexpr int LC = Ly::LC, LK = Ly::LK, LS = Ly::LS, r = 16 * I - 1;
  static_assert(tf32::wide_scratch<16, PC, 16 * I, NW>() <= Ly::SC, "scratch");
  __syncthreads();  // S free; the passes before are done with the accumulators
  for (int i = threadIdx.x; i < 16 * I * PC; i += NT) {
    const int s = i / PC, c = i % PC;
    x.S[s * LS + c] = x.ks[s * LK + c] * fast_exp(x.Gs[r * LK + c] - x.Gs[s * LK + c]);
  }
  __syncthreads();
  tf32::gemm_wide<16, PC, 16 * I, NW, PREC>(rows(x.dP + 16 * I * LC, LC), rows(x.S, LS), x.sc0, [&](int i, int c, float v) {
    const int t = 16 * I + i;
    if (t >= x.Lc) return;
    v *= fast_exp(x.Gs[t * LK + c] - x.Gs[r * LK + c]);
    x.aq[t * LK + c] += v;
    x.dGs[t * LK + c] += x.qs[t * LK + c] * v;
  });
  if (DELTA)
    tf32::gemm_wide<16, PC, 16 * I, NW, PREC>(rows(x.w + 16 * I * LC, LC), rows(x.S, LS), x.sc1, [&](int i, int c, float v) {
      const int t = 16 * I + i;
      if (t >= x.Lc) return;
      v *= fast_exp(x.Gs[t * LK + c] - x.Gs[r * LK + c]);
      x.ak[t * LK + c] += v;
      x.dGs[t * LK + c] += x.ks[t * LK + c] * v;
    });
}

// Rows of block J (J <= 2) from the tokens after it: through rho = 16 J + 15,
// dk_s += e^{G_rho - G_s} sum_t dP_ts (q_t e^{G_t - G_rho}), the same with w and k_t.
template <int K, bool DELTA, int J, int PREC>
__device__ __forceinline__ void pair_block_cols(const PairCtx<K>& x) {
  using Ly = PairLayout<K>;
  constexpr int LC = Ly::LC, LK = Ly::LK, LS = Ly::LS, rho = 16 * J + 15, t0 = 16 * (J + 1), NTK = C - t0;
  static_assert(tf32::wide_scratch<16, PC, NTK, NW>() <= Ly::SC, "scratch");
  auto epi = [&](int i, int c, float v) {
    const int s = 16 * J + i;
    if (s >= x.Lc) return;
    v *= fast_exp(x.Gs[rho * LK + c] - x.Gs[s * LK + c]);
    x.ak[s * LK + c] += v;
    x.dGs[s * LK + c] -= x.ks[s * LK + c] * v;
  };
  for (int pass = 0; pass < (DELTA ? 2 : 1); ++pass) {
    const float* src = pass == 0 ? x.qs : x.ks;
    __syncthreads();
    for (int i = threadIdx.x; i < NTK * PC; i += NT) {
      const int t = t0 + i / PC, c = i % PC;
      x.S[(i / PC) * LS + c] = src[t * LK + c] * fast_exp(x.Gs[t * LK + c] - x.Gs[rho * LK + c]);
    }
    __syncthreads();
    tf32::gemm_wide<16, PC, NTK, NW, PREC>(cols((pass == 0 ? x.dP : x.w) + t0 * LC + 16 * J, LC), rows(x.S, LS), x.sc0, epi);
  }
}

// sm_90a, the delta rule: the over-V products dP = dO Delta^T and dB Delta^T on warpgroups, every
// operand K-major as it lies (rows: tokens, columns: V), staged a 64-column slice at a time as bf16
// hi / lo tiles (bytes from the q .. G region, free in this phase). Warpgroups 0 and 1 take dP's
// columns 0..31 and 32..63, 2 and 3 dB Delta^T's. (Without the delta rule, dP alone in four quarters
// of 16 columns measured 6% slower than mma.sync at GLA 1x8192 H32.) A slice's loads are issued
// together, the next slice's while the products run. The accumulators cross the slices in registers;
// dP on and below the diagonal, dA = -stril(dB Delta^T) to their tiles after.
template <int K>
struct PairTiles {
  static constexpr int kT = C * VE * 2;
  static constexpr int dO = 0, dB = 2 * kT, D = 4 * kT, bytes = 6 * kT;
  static_assert(PairLayout<K>::q * 4 % 1024 == 0, "the tiles start on a swizzle period");
  static_assert(PairLayout<K>::q * 4 + bytes <= PairLayout<K>::dG * 4, "the tiles fit the q .. G region");
};

template <int K>
__device__ __forceinline__ void pair_products_wg(float* sm, const Params& bp, const ChunkAt& ch, int hv, float* dP, float* dA) {
  using Ly = PairLayout<K>;
  using Ty = PairTiles<K>;
  constexpr int LC = Ly::LC;
  constexpr int NQ = 4;  // n-tiles of 8 a warpgroup: 32 columns
  unsigned char* sb = reinterpret_cast<unsigned char*>(sm + Ly::q);
  const uint32_t base = mma::smem_addr(sb);
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wgi = warp / 4, w4 = warp & 3;
  const int g = lane >> 2, q2 = (lane & 3) * 2, Lc = ch.Lc;
  const bool second = wgi >= 2;  // this warpgroup's product: dB Delta^T, else dO Delta^T
  const int n0 = (wgi % 2) * 8 * NQ;
  const int64_t tok = ch.f0 * p.HV * p.V + hv * p.V, tok_ld = static_cast<int64_t>(p.HV) * p.V;
  const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  constexpr int PER = C * (VE / 4) / NT;  // float4 of each operand a thread stages per slice
  static_assert(C * (VE / 4) % NT == 0, "whole rounds");
  float4 xo[PER], xb[PER], xd[PER];
  auto load_slice = [&](int v0) {  // every load of a slice before its first store
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * NT, t = i / (VE / 4), c = (i % (VE / 4)) * 4;
      const bool in = t < Lc;
      xo[u] = in ? load4(bp.io.dO, bp.io.dO_dt,
                         ch.b_row * bp.io.dO_s[0] + (ch.t0 + t) * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0 + c)
                 : z;
      xb[u] = in ? *reinterpret_cast<const float4*>(bp.dB + tok + t * tok_ld + v0 + c) : z;
      xd[u] = in ? *reinterpret_cast<const float4*>(bp.Delta + tok + t * tok_ld + v0 + c) : z;
    }
  };
  float acc[NQ][4] = {};
  load_slice(0);
  for (int v0 = 0; v0 < p.V; v0 += VE) {
    if (v0 > 0) __syncthreads();  // the slice before read
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * NT, t = i / (VE / 4), c = (i % (VE / 4)) * 4;
      put_rows(sb + Ty::dO, Ty::kT, C, t, c, xo[u]);
      put_rows(sb + Ty::dB, Ty::kT, C, t, c, xb[u]);
      put_rows(sb + Ty::D, Ty::kT, C, t, c, xd[u]);
    }
    if (v0 + VE < p.V) load_slice(v0 + VE);  // in flight while this slice's products run
    wg::fence_proxy_async();
    __syncthreads();
    wg::fence();
    const uint32_t left = base + (second ? Ty::dB : Ty::dO);
#pragma unroll
    for (int kk = 0; kk < VE / 16; ++kk) {
      const uint64_t ah = wg::desc_kstep(left, C, 0, kk), al = wg::desc_kstep(left + Ty::kT, C, 0, kk);
      const uint64_t bh = wg::desc_kstep(base + Ty::D, C, n0, kk), bl = wg::desc_kstep(base + Ty::D + Ty::kT, C, n0, kk);
      wg::mma_bf16<NQ>(acc, ah, bh);
      wg::mma_bf16<NQ>(acc, ah, bl);
      wg::mma_bf16<NQ>(acc, al, bh);
    }
    wg::commit();
    wg::wait_all();
    wg::fence_operand(acc);
  }
  // dP on and below the diagonal; dA = -stril(dB Delta^T)
  float* out = second ? dA : dP;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int i = 16 * w4 + g + 8 * hr;
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = n0 + 8 * j + q2 + e;
        const float v = acc[j][2 * hr + e];
        out[i * LC + c] = second ? (c < i ? -v : 0.0f) : (c <= i ? v : 0.0f);
      }
  }
}

// sm_90a, one decay per token with the delta rule (GDN): a channel half's three products on
// warpgroups, bf16x3, the diagonal pairs (s = t) kept out of them. dP o E and w o E are staged once as bf16 hi / lo tiles as they lie (rows: t)
// where their fp32 copies were; q^ and k^ of the half transposed (rows: channels, the products' B
// K-major) where their fp32 copies go on the mma.sync path. Warpgroup i takes channels 16 i .. 16 i + 15
// of all three, so one thread owns an element in each: v1 = (dP o E) k^, v2 = (w o E) k^ and
// v3 = (dP o E)^T q^ + (w o E)^T k^, the transposed A read MN-major from the same tiles.
template <int K>
struct PairScalarTiles {
  using Ly = PairLayout<K>;
  static constexpr int kTile = C * C * 2;  // one 64 x 64 bf16 tile (PC = C)
  static constexpr int dP = Ly::dP * 4, w = Ly::dA * 4, qT = Ly::q * 4, kT = Ly::k * 4;
  static_assert(PC == C && dP % 1024 == 0 && w % 1024 == 0 && qT % 1024 == 0 && kT % 1024 == 0, "swizzle periods");
  static_assert(dP + 2 * kTile <= w && w + 2 * kTile <= qT && qT + 2 * kTile <= kT && kT + 2 * kTile <= Ly::G * 4,
                "each pair of tiles fits where its fp32 matrix was");
};

// d += op(A) op(B) over one k-step of 16 at N = 16 in bf16x3: hi hi' + hi lo' + lo hi'.
template <int TA, int TB>
__device__ __forceinline__ void mma3_n16(float (&d)[2][4], uint64_t ah, uint64_t al, uint64_t bh, uint64_t bl) {
  wg::mma_bf16_n16<TA, TB>(d, ah, bh);
  wg::mma_bf16_n16<TA, TB>(d, ah, bl);
  wg::mma_bf16_n16<TA, TB>(d, al, bh);
}

template <int K>
__device__ __forceinline__ void pair_scalar_products(uint32_t base, float (&v1)[2][4], float (&v2)[2][4],
                                                     float (&v3)[2][4]) {
  using Ty = PairScalarTiles<K>;
  const int n0 = 16 * (threadIdx.x / 128);
  wg::fence();
#pragma unroll 1  // (unrolled, the k-steps' descriptors stay live together and spill)
  for (int kk = 0; kk < C / 16; ++kk) {
    const uint64_t kh = wg::desc_kstep(base + Ty::kT, PC, n0, kk), kl = wg::desc_kstep(base + Ty::kT + Ty::kTile, PC, n0, kk);
    const uint64_t qh = wg::desc_kstep(base + Ty::qT, PC, n0, kk), ql = wg::desc_kstep(base + Ty::qT + Ty::kTile, PC, n0, kk);
    const uint64_t ph = wg::desc_kstep(base + Ty::dP, C, 0, kk), pl = wg::desc_kstep(base + Ty::dP + Ty::kTile, C, 0, kk);
    const uint64_t pth = wg::desc_mn(base + Ty::dP, C, kk, 0), ptl = wg::desc_mn(base + Ty::dP + Ty::kTile, C, kk, 0);
    const uint64_t wh = wg::desc_kstep(base + Ty::w, C, 0, kk), wl = wg::desc_kstep(base + Ty::w + Ty::kTile, C, 0, kk);
    const uint64_t wth = wg::desc_mn(base + Ty::w, C, kk, 0), wtl = wg::desc_mn(base + Ty::w + Ty::kTile, C, kk, 0);
    mma3_n16<0, 0>(v1, ph, pl, kh, kl);
    mma3_n16<1, 0>(v3, pth, ptl, qh, ql);
    mma3_n16<0, 0>(v2, wh, wl, kh, kl);
    mma3_n16<1, 0>(v3, wth, wtl, kh, kl);
  }
  wg::commit();
  wg::wait_all();
  wg::fence_operand(v1);
  wg::fence_operand(v2);
  wg::fence_operand(v3);
}

template <int K, bool DELTA, bool SCALAR, int PREC>
__global__ void __launch_bounds__(NT) pair_grad_kernel(const Params bp) {
  using Ly = PairLayout<K>;
  using F = Fac<K>;
  constexpr int L = Ly::L, LC = Ly::LC, LK = Ly::LK;
  constexpr int64_t PW = bwd::part_width(K);
  extern __shared__ __align__(1024) float sm[];  // (the sm_90a tiles' swizzle repeats every 1024 bytes)
  float *dP = sm + Ly::dP, *dA = sm + Ly::dA, *dO = sm + Ly::dO, *dB = sm + Ly::dB, *Dl = sm + Ly::D;
  float *qs = sm + Ly::q, *ks = sm + Ly::k, *Gs = sm + Ly::G, *dGs = sm + Ly::dG, *aq = sm + Ly::aq, *ak = sm + Ly::ak;
  float *bet = sm + Ly::beta, *gs = sm + Ly::g;
  const FwdParams& p = bp.f;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int cidx = static_cast<int>(blockIdx.x / p.HV), hv = static_cast<int>(blockIdx.x % p.HV);
  const int h = hv / (p.HV / p.H);
  ChunkAt ch;
  if (!chunk_at(bp, cidx, ch)) return;
  const float* fac = bp.fac + (static_cast<int64_t>(cidx) * p.HV + hv) * F::size;
  const int Lc = ch.Lc;
  const PairCtx<K> x{dP, dA, qs, ks, Gs, dGs, aq, ak, sm + Ly::S, sm + Ly::sc, sm + Ly::sc + Ly::SC, Lc};
  float* const part = bp.part + (ch.f0 * p.HV + hv) * PW;  // token t's part row: part + t row_ld
  const int64_t row_ld = p.HV * PW;
  const int64_t tok = ch.f0 * p.HV * p.V + hv * p.V, tok_ld = static_cast<int64_t>(p.HV) * p.V;

  // dP = tril(dO Delta^T), and dB Delta^T, over V
  if (tid < C) bet[tid] = tid < Lc ? bp.x.beta[(ch.f0 + tid) * p.HV + hv] : 0.0f;
  if (SCALAR && tid < C) gs[tid] = fac[F::G + tid * K];  // one decay for every channel
  // sm_90a: the key kernel's terms of the first channel half (dq^, dk^, dG) copied in while phase 1
  // runs (its operands use the q .. G region only). The other passes keep the form measured before
  // (the sm_80 pass spills 96 bytes with this and da's segments below, where it spilled 8).
  constexpr bool kEarlyPart = CULA_WGMMA;
  if constexpr (kEarlyPart) {
    rows_async4<C, PC>(aq, LK, part, row_ld, Lc);
    rows_async4<C, PC>(ak, LK, part + K, row_ld, Lc);
    rows_async4<C, PC>(dGs, LK, part + 2 * K, row_ld, Lc);
    mma::cp_async_commit();
  }
  // With the delta rule on warpgroups, beta's sums have every load issued before phase 1 (its products
  // leave the registers free): warp w takes rows w + NW j, lane l the pairs s = l, l + 32 and the value
  // kernel's column slices l, l + 32, ... (on the mma.sync path the accumulators would spill them).
  constexpr int RW = C / NW;
  float kek[RW][2], dbs[RW];
  if constexpr (CULA_WGMMA && DELTA) {
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      const int t = warp + NW * j;
      kek[j][0] = lane < t && t < Lc ? fac[F::KEK + t * C + lane] : 0.0f;
      kek[j][1] = lane + 32 < t && t < Lc ? fac[F::KEK + t * C + lane + 32] : 0.0f;
      dbs[j] = 0.0f;
      if (t < Lc)
        for (int sl = lane; sl < p.V / VE; sl += 32) dbs[j] += bp.dbeta_part[(sl * bp.BT + ch.f0 + t) * p.HV + hv];
    }
    pair_products_wg<K>(sm, bp, ch, hv, dP, dA);
  } else {
    tf32::Acc<C, C, NW> aP, aA;
    aP.zero(), aA.zero();
    for (int v0 = 0; v0 < p.V; v0 += VE) {
      __syncthreads();
      if (DELTA) {
        rows_async<C, VE>(dB, L, bp.dB + tok + v0, tok_ld, Lc);
        rows_async<C, VE>(Dl, L, bp.Delta + tok + v0, tok_ld, Lc);
        mma::cp_async_commit();
      } else {
        input_rows<C, VE>(Dl, L, p.v, p.v_dt, ch.b_row * p.v_s[0] + ch.t0 * p.v_s[1] + hv * p.v_s[2] + v0, p.v_s[1], Lc);
      }
      input_rows<C, VE>(dO, L, bp.io.dO, bp.io.dO_dt, ch.b_row * bp.io.dO_s[0] + ch.t0 * bp.io.dO_s[1] + hv * bp.io.dO_s[2] + v0, bp.io.dO_s[1], Lc);
      if (DELTA) mma::cp_async_wait_all();
      __syncthreads();
      aP.add<VE, PREC>(rows(dO, L), cols(Dl, L));
      if (DELTA) aA.add<VE, PREC>(rows(dB, L), cols(Dl, L));
    }
    // dP on and below the diagonal; dA = -stril(dB Delta^T)
    aP.drain([&](int i, int j, float v) { dP[i * LC + j] = j <= i ? v : 0.0f; });
    if (DELTA) aA.drain([&](int i, int j, float v) { dA[i * LC + j] = j < i ? -v : 0.0f; });
  }
  __syncthreads();  // phase 1's buffers end
  // beta: its sums from the value kernel's column slices, and A's term sum_s dA_ts KEK_ts
  if constexpr (CULA_WGMMA && DELTA) {
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      const int t = warp + NW * j;
      const float s = dev::warp_sum(dbs[j] + dA[t * LC + lane] * kek[j][0] + dA[t * LC + lane + 32] * kek[j][1]);
      if (lane == 0 && t < Lc) part[t * row_ld + 3 * K] = s;
    }
  } else {
    for (int t = warp; t < Lc; t += NW) {
      float s = 0.0f;
      if (DELTA)
        for (int u = lane; u < t; u += 32) s += dA[t * LC + u] * fac[F::KEK + t * C + u];
      s = dev::warp_sum(s);
      if (lane == 0) {
        if (DELTA)
          for (int sl = 0; sl < p.V / VE; ++sl) s += bp.dbeta_part[(sl * bp.BT + ch.f0 + t) * p.HV + hv];
        part[t * row_ld + 3 * K] = DELTA ? s : 0.0f;
      }
    }
  }
  // The diagonal pairs (s = t) stay out of the products: their dG terms (q^_t dP_tt k^_t from dq^'s
  // product, k^_t dP_tt q^_t from dk^'s) cancel exactly, so they are not added at all, and their dq^
  // and dk^ terms are added in fp32 from dP_tt in the write back. With them in the products, one
  // token and no initial state (dg exactly 0) left noise past the tests' floor: 1e-7 from bf16x3
  // (GDN), 6e-5 from one TF32 product (simple GLA on bf16 inputs, a final-state gradient, V = 256).
  // Without the delta rule one product a warpgroup does not pay for the staging (simple GLA and
  // Lightning 1x8192 H32: pair 0.82 -> 0.83 ms).
  constexpr bool kWgScalar = CULA_WGMMA && SCALAR && DELTA;
  float* const dPdiag = sm + Ly::S + 48 * Ly::LS - C;  // (SCALAR: dP_tt, past the segments of da's sum in S)
  using STy = PairScalarTiles<K>;
  unsigned char* const sb = reinterpret_cast<unsigned char*>(sm);
  if constexpr (kWgScalar) {  // dP o E and w o E (w = beta_t dA_ts) into their tiles, in place: all read first
    constexpr int PER = C * (C / 4) / NT;
    static_assert(C * (C / 4) % NT == 0, "whole rounds");
    float4 xp[PER], xw[PER];
    __syncthreads();  // beta's sums have read dA
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * NT, t = i / (C / 4), s0 = (i % (C / 4)) * 4;
      float e[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) e[j] = s0 + j < t ? fast_exp(gs[t] - gs[s0 + j]) : 0.0f;  // the diagonal: 0
      const float4 a = *reinterpret_cast<const float4*>(dP + t * LC + s0);
      if (t >= s0 && t < s0 + 4) dPdiag[t] = t == s0 ? a.x : t == s0 + 1 ? a.y : t == s0 + 2 ? a.z : a.w;
      xp[u] = make_float4(a.x * e[0], a.y * e[1], a.z * e[2], a.w * e[3]);
      const float4 b = *reinterpret_cast<const float4*>(dA + t * LC + s0);
      const float bt = bet[t];
      xw[u] = make_float4(b.x * bt * e[0], b.y * bt * e[1], b.z * bt * e[2], b.w * bt * e[3]);
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * NT, t = i / (C / 4), s0 = (i % (C / 4)) * 4;
      put_rows(sb + STy::dP, STy::kTile, C, t, s0, xp[u]);
      put_rows(sb + STy::w, STy::kTile, C, t, s0, xw[u]);
    }
  } else if (DELTA || SCALAR) {  // dA turns into w = beta_t dA_ts; with one decay, dP and w take E_ts = e^{G_t - G_s}
    __syncthreads();
    for (int i = tid; i < C * C; i += NT) {
      const int t = i / C, u = i % C;
      const float e = SCALAR ? (u < t ? fast_exp(gs[t] - gs[u]) : 0.0f) : 1.0f;  // the diagonal: 0 (as above)
      if (SCALAR) {
        if (u == t) dPdiag[t] = dP[t * LC + u];
        dP[t * LC + u] *= e;
      }
      if (DELTA) dA[t * LC + u] *= bet[t] * e;
    }
  }
  // the channels in halves of PC: dP and w formed once above, for both
  for (int c0 = 0; c0 < K; c0 += PC) {
    __syncthreads();  // w scaled; the half before written back
    const int64_t qk_ld = static_cast<int64_t>(p.H) * K;
    const float *qg = bp.x.qh + (ch.f0 * p.H + h) * K + c0, *kg = bp.x.kh + (ch.f0 * p.H + h) * K + c0;
    if constexpr (kWgScalar) {
      const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      static_assert((C / 2) * (PC / 4) == NT, "one pair of rows of four channels a thread");
      const int t = 2 * (tid / (PC / 4)), c = (tid % (PC / 4)) * 4;
      const float4 q0 = t < Lc ? *reinterpret_cast<const float4*>(qg + t * qk_ld + c) : z,
                   q1 = t + 1 < Lc ? *reinterpret_cast<const float4*>(qg + (t + 1) * qk_ld + c) : z,
                   k0 = t < Lc ? *reinterpret_cast<const float4*>(kg + t * qk_ld + c) : z,
                   k1 = t + 1 < Lc ? *reinterpret_cast<const float4*>(kg + (t + 1) * qk_ld + c) : z;
      put_pairs_t(sb + STy::qT, STy::kTile, PC, t, c, q0, q1);
      put_pairs_t(sb + STy::kT, STy::kTile, PC, t, c, k0, k1);
      wg::fence_proxy_async();
    } else {
      rows_async<C, PC>(qs, LK, qg, qk_ld, Lc);
      rows_async<C, PC>(ks, LK, kg, qk_ld, Lc);
    }
    if (!SCALAR) rows_async<C, PC>(Gs, LK, fac + F::G + c0, K);
    mma::cp_async_commit();
    if (!kEarlyPart || c0 > 0) {  // the key kernel's terms of dq^, dk^ and dG (on sm_90a the first half's came with phase 1)
      constexpr int PER = C * PC / NT;
      float rq[PER], rk[PER], rg[PER];
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int i = tid + u * NT, t = i / PC, c = c0 + i % PC;
        const float* pr = part + t * row_ld;
        rq[u] = t < Lc ? pr[c] : 0.0f;
        rk[u] = t < Lc ? pr[K + c] : 0.0f;
        rg[u] = t < Lc ? pr[2 * K + c] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int i = tid + u * NT, t = i / PC, c = i % PC;
        aq[t * LK + c] = rq[u], ak[t * LK + c] = rk[u], dGs[t * LK + c] = rg[u];
      }
    }
    mma::cp_async_wait_all();
    __syncthreads();

    if constexpr (kWgScalar) {
      float v1[2][4] = {}, v2[2][4] = {}, v3[2][4] = {};
      pair_scalar_products<K>(mma::smem_addr(sb), v1, v2, v3);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int t = 16 * (warp & 3) + (lane >> 2) + 8 * hr, c = 16 * (warp / 4) + 8 * j + (lane & 3) * 2 + e;
            const float a = v1[j][2 * hr + e], b = v2[j][2 * hr + e], d = v3[j][2 * hr + e];
            // q^ and k^ at (t, c) as their tiles hold them (hi + lo, within 2^-16): nothing held across the products
            const int off = wg::sw128_offset(PC, c, t);
            const float qv = tile_value(sb + STy::qT + off, STy::kTile), kv = tile_value(sb + STy::kT + off, STy::kTile);
            aq[t * LK + c] += a;  // (the diagonal pairs' terms: in the write back below)
            ak[t * LK + c] += b + d;
            dGs[t * LK + c] += qv * a + kv * (b - d);
          }
    } else if (SCALAR) {
      // dP o E and w o E whole on tensor cores: dq^_t += sum_s (dP o E)_ts k^_s, dk^_t += sum_s (w o E)_ts
      // k^_s, and dk^_s += sum_t (dP o E)_ts q^_t + (w o E)_ts k^_t as one product over the stacked
      // [dP; w] and [q^; k^]. The three products have one shape, so one thread owns an element in all.
      tf32::gemm<C, PC, C, NW, 2, PREC>(rows(dP, LC), rows(ks, LK), [&](int t, int c, float v) {
        aq[t * LK + c] += v;
        dGs[t * LK + c] += qs[t * LK + c] * v;
      });
      if (DELTA)
        tf32::gemm<C, PC, C, NW, 2, PREC>(rows(dA, LC), rows(ks, LK), [&](int t, int c, float v) {
          ak[t * LK + c] += v;
          dGs[t * LK + c] += ks[t * LK + c] * v;
        });
      tf32::gemm<C, PC, DELTA ? 2 * C : C, NW, 2, PREC>(cols(dP, LC), rows(qs, LK), [&](int u, int c, float v) {
        ak[u * LK + c] += v;
        dGs[u * LK + c] -= ks[u * LK + c] * v;
      });
    } else {
      // diagonal blocks, exact per channel: thread (channel c, block I, parity h), each pair once
      const int c = tid % PC, b = 16 * ((tid / PC) % 4), par = tid / (4 * PC);
      float col[16];
      if (par == 0) pair_diag_rows<K, DELTA, 0>(dP, dA, qs, ks, Gs, aq, ak, dGs, c, b, col);
      else pair_diag_rows<K, DELTA, 1>(dP, dA, qs, ks, Gs, aq, ak, dGs, c, b, col);
      for (int ph = 0; ph < 2; ++ph) {  // the column sums of the two parities, in this order
        __syncthreads();  // (the row sums written)
        if (par == ph)
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int u = (b + j) * Ly::LK + c;
            ak[u] += col[j];
            dGs[u] -= ks[u] * col[j];
          }
      }
      // off the diagonal, on tensor cores
      pair_block_rows<K, DELTA, 1, PREC>(x);
      pair_block_rows<K, DELTA, 2, PREC>(x);
      pair_block_rows<K, DELTA, 3, PREC>(x);
      pair_block_cols<K, DELTA, 0, PREC>(x);
      pair_block_cols<K, DELTA, 1, PREC>(x);
      pair_block_cols<K, DELTA, 2, PREC>(x);
    }
    __syncthreads();
    for (int i = tid; i < Lc * PC; i += NT) {  // dq^ and dk^ terms back, once
      const int t = i / PC, cc = i % PC;
      float* pr = part + t * row_ld + c0 + cc;
      float dq = aq[t * LK + cc], dk = ak[t * LK + cc];
      if constexpr (kWgScalar) {  // the diagonal pairs: dq^_t += dP_tt k^_t, dk^_t += dP_tt q^_t
        const int off = wg::sw128_offset(PC, cc, t);
        dq += dPdiag[t] * tile_value(sb + STy::kT + off, STy::kTile);
        dk += dPdiag[t] * tile_value(sb + STy::qT + off, STy::kTile);
      } else if constexpr (SCALAR) {
        dq += dPdiag[t] * ks[t * LK + cc];
        dk += dPdiag[t] * qs[t * LK + cc];
      }
      pr[0] = dq;
      pr[K] = dk;
    }
    if constexpr (!kEarlyPart) {
      for (int cc = tid; cc < PC; cc += NT) {  // da: G_t = sum_{s <= t} a_s
        float acc = 0.0f;
        for (int t = Lc - 1; t >= 0; --t) {
          acc += dGs[t * LK + cc];
          part[t * row_ld + 2 * K + c0 + cc] = acc;
        }
      }
    } else {  // da: G_t = sum_{s <= t} a_s, so da_s = sum_{t >= s} dG_t; thread (channel, segment of SL tokens)
      constexpr int NSEG = NT / PC, SL = C / NSEG;
      static_assert(NT % PC == 0 && C % NSEG == 0 && NSEG * PC <= 48 * Ly::LS - C, "segments (then dP_tt)");
      const int cc = tid % PC, sg = tid / PC;
      float v[SL], tot = 0.0f;
#pragma unroll
      for (int j = SL - 1; j >= 0; --j) {
        if (sg * SL + j < Lc) tot += dGs[(sg * SL + j) * LK + cc];
        v[j] = tot;
      }
      x.S[sg * PC + cc] = tot;  // (S is free: the block passes are done)
      __syncthreads();
      float later = 0.0f;
      for (int k = NSEG - 1; k > sg; --k) later += x.S[k * PC + cc];
#pragma unroll
      for (int j = 0; j < SL; ++j) {
        const int t = sg * SL + j;
        if (t < Lc) part[t * row_ld + 2 * K + c0 + cc] = v[j] + later;
      }
    }
  }  // halves
}

// ---- host --------------------------------------------------------------------------------------
// The products of calls on bf16 inputs whose gate is not activated in the kernel (no dA_log or
// d dt_bias, the sums that cancel over every token): one TF32 product, about 0.05x of FLA's
// tolerances in the error model (DESIGN.md, bwd_rounding.py). bf16 products measured slower (their
// operands converted and packed per k-step) and past FLA's dg tolerance in a test case.
constexpr int kFastProducts = tf32::kOneTF32;
constexpr int VS = 16;  // columns per scan CTA: the two roles' shared memory fits two CTAs per SM
// Without the delta rule (no W tile) a 32-column scan CTA still fits two per SM at K <= 128, and each
// step's products serve twice the columns for one chain of barriers. It pays where the grid stays
// at least 1.5 CTAs per SM (H200, backward scans: GLA, simple GLA and Lightning 1x8192 H32 -22%,
// simple GLA 4x2048 H16 -19%); below that the step's latency is the scan's time, and half the CTAs
// means twice the steps' work on each (1x8192 H8: +41%). The plan: scan_width.h.
constexpr int VS_WIDE = 32;
template <int K, bool DELTA>
constexpr bool wide_scans_fit() {
  return !DELTA && K <= 128;
}

// The scans on warpgroups (sm_90a, the delta rule, K <= 128) at 32 or 64 columns a CTA, one CTA per
// SM (the width: scan_width.h). The launch also fits the mma.sync layout at that width, which a
// build without sm_90a code runs instead.
template <int K, bool DELTA, int W>
constexpr int scan_bytes() {
  constexpr int b = ScanLayout<K, DELTA, W>::bytes;
  if constexpr (wg_scan<K, DELTA, W>()) return b > ScanTiles<K, W>::bytes ? b : ScanTiles<K, W>::bytes;
  return b;
}
// (taken on sm_90 only, whose 227 KB a CTA are not part of max_smem's device check below)
static_assert(scan_bytes<128, true, 64>() <= 227 * 1024, "the 64-column scans fit an sm_90 CTA");

template <int K, bool DELTA>
int max_smem() {
  int b = FactorsLayoutOf<K, DELTA>::bytes;
  b = b > ScanInputsLayout<K>::bytes ? b : ScanInputsLayout<K>::bytes;
  b = b > ScanLayout<K, DELTA, VS>::bytes ? b : ScanLayout<K, DELTA, VS>::bytes;
  if (wide_scans_fit<K, DELTA>()) b = b > ScanLayout<K, DELTA, VS_WIDE>::bytes ? b : ScanLayout<K, DELTA, VS_WIDE>::bytes;
  b = b > ValueLayout<K>::bytes ? b : ValueLayout<K>::bytes;
  b = b > KeyLayout::bytes ? b : KeyLayout::bytes;
  return b > PairLayout<K>::bytes ? b : PairLayout<K>::bytes;
}

// f(std::integral_constant<int, K>) for the key head sizes the chunk form takes (64, 128, 256)
template <class F>
auto with_key_size(int K, F&& f) {
  if (K == 64) return f(std::integral_constant<int, 64>{});
  if (K == 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 256>{});
}

int smem_needed(const Recurrence& r) {
  return with_key_size(static_cast<int>(r.K), [&](auto k) {
    return r.tr.delta ? max_smem<decltype(k)::value, true>() : max_smem<decltype(k)::value, false>();
  });
}

template <int K, bool DELTA, bool SCALAR, int PREC>
void run_kernels(const Params& bp, int64_t chunks, int N, int HV, int V, int sms, bool wgmma, cudaStream_t stream) {
  auto go = [&](auto kernel, int64_t grid, int bytes, int threads = NT) {
    if (grid <= 0) return;
    chunk::allow_smem(kernel, bytes);
    kernel<<<static_cast<unsigned>(grid), threads, bytes, stream>>>(bp);
  };
  go(chunk_factors_kernel<K, DELTA, SCALAR, PREC>, chunks * HV, FactorsLayoutOf<K, DELTA>::bytes);
  go(scan_inputs_kernel<K, DELTA, PREC>, chunks * HV * (V / VE), ScanInputsLayout<K>::bytes);
  auto scans = [&](auto width) {
    constexpr int W = decltype(width)::value;
    go(state_scans_kernel<K, DELTA, W, PREC>, 2 * static_cast<int64_t>(N) * HV * (V / W), scan_bytes<K, DELTA, W>(), ST);
  };
  const int width = bwd::scan_width(DELTA, K, N, HV, V, sms, wgmma);
  if constexpr (wg_scan<K, DELTA, 32>()) {
    if (width == 64) scans(std::integral_constant<int, 64>{});
    else if (width == 32) scans(std::integral_constant<int, 32>{});
    else scans(std::integral_constant<int, VS>{});
  } else if constexpr (wide_scans_fit<K, DELTA>()) {
    if (width == VS_WIDE) scans(std::integral_constant<int, VS_WIDE>{});
    else scans(std::integral_constant<int, VS>{});
  } else {
    scans(std::integral_constant<int, VS>{});
  }
  if (DELTA) go(value_grad_kernel<K, PREC>, chunks * HV * (V / VE), ValueLayout<K>::bytes);
  go(key_grad_kernel<K, DELTA, PREC>, chunks * HV * (K / VE), KeyLayout::bytes, KeyShape<DELTA>::threads);
  go(pair_grad_kernel<K, DELTA, SCALAR, PREC>, chunks * HV, PairLayout<K>::bytes);
}

}  // namespace

Refusal cuda_chunk_bwd_declines(const Recurrence& r, const cula_chunk_bwd_args& a) {
  // the recurrent row's input rules first: what it refuses, this row refuses the same way
  if (Refusal why = cuda_recurrent_bwd_declines(r, a)) return why;
  if (r.K != 64 && r.K != 128 && r.K != 256) return Refusal::prefers("the chunk form takes K in {64, 128, 256}");
  if (r.V % VE != 0) return Refusal::prefers("the chunk form takes V a multiple of 64");
  for (const cula_tensor* t : {a.v, a.d_out}) {
    const int dt = t->dtype;
    if ((dt != CULA_BFLOAT16 && dt != CULA_FLOAT16 && dt != CULA_FLOAT32) || !chunk::aligned16(t))
      return Refusal::prefers("v and d_out are not 16-byte aligned bfloat16, float16 or float32 tensors with unit last stride");
  }
  if (cuda_device_arch(a.q->device_id) < 80) return Refusal::prefers("a device below sm_80 (mma.sync TF32, cp.async)");
  if (smem_needed(r) > cuda_smem_per_block(a.q->device_id)) return Refusal::prefers("its shared memory exceeds the device's");
  return Refusal::takes();
}

void cuda_chunk_bwd(const Recurrence& r, const cula_chunk_bwd_args& a) {
  const char* op = "chunk_bwd";
  const int device = a.q->device_id;
  bwd::check(cudaSetDevice(device), "cudaSetDevice");
  if (lean_form(r, device)) return cuda_lean_bwd(r, a);  // no delta rule, one decay per token (lean_bwd.cu)
  const cudaStream_t stream = static_cast<cudaStream_t>(a.opt.stream);
  const int64_t BT = r.B * r.T, K = r.K, V = r.V, HV = r.HV;
  using bwd::align256;

  Params bp{};
  bp.f = make_fwd_params(r, bwd::forward_args(a));
  const int64_t chunks = chunk::max_chunks(bp.f);
  if (chunks * HV >= (int64_t{1} << 31) / 2) throw_unsupported(op, "too many chunks x heads for one launch");
  const int64_t fac_floats = with_key_size(static_cast<int>(K), [](auto k) { return int64_t{Fac<decltype(k)::value>::size}; });
  const int64_t state_bytes = align256(chunks * HV * K * V * 4), tok_v = align256(BT * HV * V * 4);
  const int64_t sizes[] = {
      chunk::base_bytes(bp.f),                             // chunk_base
      bwd::token_inputs_bytes(r),                          // q^, k^, a, beta
      state_bytes,                                         // S0
      align256(chunks * HV * fac_floats * 4),              // factors
      state_bytes,                                         // dS
      (r.tr.delta ? 3 : 2) * tok_v,                        // dDelta (X), Delta (U), dB; or X, U
      r.tr.delta ? align256((V / VE) * BT * HV * 4) : 0,   // beta's partial sums
      align256(BT * HV * bwd::part_width(K) * 4),          // part
      bwd::chain_bytes(r),                                 // chain
  };
  chunk::Workspace ws(bwd::total_bytes(sizes), device, stream, op);
  char* at[sizeof(sizes) / sizeof(sizes[0])];
  bwd::carve(ws.get(), sizes, at);
  bp.chunk_base = a.cu_seqlens ? reinterpret_cast<int32_t*>(at[0]) : nullptr;
  bp.x = bwd::token_inputs_at(at[1], r);
  bp.S0 = reinterpret_cast<float*>(at[2]);
  bp.fac = reinterpret_cast<float*>(at[3]);
  bp.dS = reinterpret_cast<float*>(at[4]);
  bp.X = reinterpret_cast<float*>(at[5]);
  bp.U = reinterpret_cast<float*>(at[5] + tok_v);
  if (r.tr.delta) {
    bp.dDelta = bp.X, bp.Delta = bp.U;
    bp.dB = reinterpret_cast<float*>(at[5] + 2 * tok_v);
    bp.dbeta_part = reinterpret_cast<float*>(at[6]);
  }
  bp.part = reinterpret_cast<float*>(at[7]);
  bp.io = bwd::grad_io(a);
  bp.BT = BT;

  if (bp.chunk_base) chunk::launch_chunk_base(bp.f, bp.chunk_base, stream);
  bwd::launch_token_inputs(bp.f, bp.x, /*log_decay=*/true, stream);
  const int N = static_cast<int>(r.N), sms = cuda_sm_count(device);
  const bool wgmma = cuda_device_arch(device) == 90;  // the sm_90a code's kernels (wgmma.cuh)
  with_key_size(static_cast<int>(K), [&](auto k) {
    constexpr int KK = decltype(k)::value;
    const int hv = static_cast<int>(HV), v = static_cast<int>(V);
    // the products' precision: 3xTF32 where the gate is activated in the kernel, whose parameter
    // gradients (dA_log, d dt_bias) sum terms that cancel over every token, and for float32 and
    // fp16 inputs. FLA's kernels keep their intermediates in the input type: on bf16 inputs one
    // TF32 product (10-bit operands) is still finer than FLA's 8-bit ones, on fp16 it only ties
    // them, and a gate computed outside the kernel then sums one-TF32 dg over every token in
    // autograd (FLA's test_gdn.py::test_chunk_gate_in_kernel_varlen, fp16: dA_log 2.6e-2 from the
    // in-kernel gate's, against 2e-2). kFastProducts on bf16 inputs.
    const bool precise = r.gate_in_kernel || a.q->dtype != CULA_BFLOAT16 || a.v->dtype != CULA_BFLOAT16;
    auto run = [&](auto delta, auto scalar) {
      constexpr bool D = decltype(delta)::value, SC = decltype(scalar)::value;
      if (precise) run_kernels<KK, D, SC, tf32::kThreeTF32>(bp, chunks, N, hv, v, sms, wgmma, stream);
      else run_kernels<KK, D, SC, kFastProducts>(bp, chunks, N, hv, v, sms, wgmma, stream);
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (r.tr.gate == GateKind::PerChannel) {
      if (r.tr.delta) run(yes{}, no{});
      else run(no{}, no{});
    } else {  // a scalar or constant decay: the pair matrices whole on tensor cores
      if (r.tr.delta) run(yes{}, yes{});
      else run(no{}, yes{});
    }
  });
  bwd::check(cudaGetLastError(), "kernel launch");
  bwd::launch_chain(r, a, bp.f, bp.part, /*tiles=*/1, at[8], stream);
  const cudaError_t launched = cudaGetLastError();
  ws.release();
  bwd::check(launched, "kernel launch");
}

}  // namespace cula
