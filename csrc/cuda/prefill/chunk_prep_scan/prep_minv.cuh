// Stage of the prep kernel: Minv, the inverse of the chunk's unit lower-triangular M (64 x 64 as 16 x 16
// blocks), into the T buffer as bf16. Diagonal blocks by substitution in fp32 before B_f, the
// off-diagonal ones by halves with mma after it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kerutils/mbarrier.cuh"
#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_common.cuh"

namespace cula {
namespace chunk_prep_scan {

// Diagonal blocks of Minv: lane c < 16 solves column c by substitution, in fp32.
// m_s: M in fp32 (row stride Ly::MS); t_s: Minv in bf16 (row stride Ly::LDT); bI: the block's
// first row. Called by lanes 0-15 of the warp that owns row block bI / 16.
template <class Ly>
__device__ __forceinline__ void invert_diagonal_block(const float* m_s, bf16* t_s, int bI, int lane) {
  constexpr int MS = Ly::MS, LDT = Ly::LDT;
  float xcol[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float acc = i == lane ? 1.0f : 0.0f;
#pragma unroll
    for (int l = 0; l < i; ++l) acc -= m_s[(bI + i) * MS + bI + l] * xcol[l];
    xcol[i] = acc;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) t_s[(bI + i) * LDT + bI + lane] = __float2bfloat16_rn(xcol[i]);
}

// Off-diagonal blocks by halves (the first four warps): Minv = [[Ainv, 0], [-Dinv C Ainv, Dinv]]
// for M = [[A, 0], [C, D]] split at row 32. Blocks (1,0) and (3,2) (the halves' inverses: Minv_10
// = -Minv_11 M_10 Minv_00) by warps 0 and 1; then the bottom-left quarter, block (r,c) = -sum_P Z_rP
// Minv_Pc with Z_rP = sum_{L=2..r} Minv_rL M_LP, one block per warp. The products with a diagonal
// inverse only go before the halves' barrier, so the chain is four products deep (it was nine, in
// warp 0, behind three shared-memory round trips) and every warp has a share.
// Z stays in registers: an accumulator is the A fragment of the next product.
// Run by every warp of the CTA after B_f: the first four (kh = 0) compute, the others take part
// in B_f2 only where they are not busy elsewhere (kOverlap false: the block-barriers-only mode).
template <class Ly, int NT, bool kOverlap>
__device__ __forceinline__ void invert_off_diagonal(const float* m_s, bf16* t_s, bool m_lo, int I, int kh, int lane, int g,
                                                    int t) {
  constexpr int MS = Ly::MS, LDT = Ly::LDT;
  // M block (Lb, Pb) as the B operand [k][n] in bf16; with m_lo (fp16 inputs) also its rounded
  // remainder, a second plane whose products go into the same accumulators: M's rounding to one
  // plane was the largest error of fp16 GDN's state (1024 tokens without decay: 7.2e-3 -> 5.7e-3
  // in tools/analysis/gdn_fp16_rounding.py's model; with v and Kt's k exact, 3.5e-3, measured 3.4e-3)
  auto m_frag_b = [&](int Lb, int Pb, uint32_t (&b)[4], uint32_t (&bl)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // n-tile r / 2, k rows 2t (+ 8 for odd r)
      const float* col = m_s + (16 * Lb + 2 * t + 8 * (r & 1)) * MS + 16 * Pb + 8 * (r >> 1) + g;
      const float x0 = col[0], x1 = col[MS];
      b[r] = pack(x0, x1);
      if (m_lo) {
        const float2 h = unpack(b[r]);
        bl[r] = pack(x0 - h.x, x1 - h.y);
      }
    }
  };
  auto t_frag_a = [&](int Ib, int Lb, uint32_t (&a)[4]) {
    mma::ldsm_x4(a, t_s + (16 * Ib + mma::a_row(lane)) * LDT + 16 * Lb + mma::a_col(lane));
  };
  auto t_frag_b = [&](int Lb, int Pb, uint32_t (&b)[4]) {
    mma::ldsm_x4_t(b, t_s + (16 * Lb + mma::bk_row(lane)) * LDT + 16 * Pb + mma::bk_col(lane));
  };
  auto mma2 = [](float (&x)[2][4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
    mma::mma16816(x[0], a, b[0], b[1]);
    mma::mma16816(x[1], a, b[2], b[3]);
  };
  auto as_a = [](const float (&x)[2][4], uint32_t (&a)[4]) {  // accumulator -> A fragment
    a[0] = pack(x[0][0], x[0][1]), a[1] = pack(x[0][2], x[0][3]);
    a[2] = pack(x[1][0], x[1][1]), a[3] = pack(x[1][2], x[1][3]);
  };
  auto store_neg = [&](int Ib, int Jb, const float (&x)[2][4]) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        u32at(t_s + (16 * Ib + g + 8 * hh) * LDT + 16 * Jb + nt * 8 + 2 * t) = pack(-x[nt][2 * hh], -x[nt][2 * hh + 1]);
  };
  if (kh == 0) {
    uint32_t a[4], b[4], bl[4];
    if (I < 2) {  // the halves: (1,0) by warp 0, (3,2) by warp 1
      const int Ib = 2 * I + 1, Jb = 2 * I;
      float z[2][4] = {}, x[2][4] = {};
      t_frag_a(Ib, Ib, a);
      m_frag_b(Ib, Jb, b, bl);
      mma2(z, a, b);
      if (m_lo) mma2(z, a, bl);
      as_a(z, a);
      t_frag_b(Jb, Jb, b);
      mma2(x, a, b);
      store_neg(Ib, Jb, x);
    }
    // bottom-left quarter: warp 0 (3,1), warp 1 (2,1), warp 2 (2,0), warp 3 (3,0)
    const int r = I == 1 || I == 2 ? 2 : 3, c = I >= 2 ? 0 : 1;
    float z[2][2][4] = {};  // Z_rP, P = c..1 (unrolled: register arrays)
    t_frag_a(r, r, a);
#pragma unroll
    for (int P = 0; P < 2; ++P)  // Z_rP = Minv_rr M_rP (+ Minv_32 M_2P after the barrier, r = 3)
      if (P >= c) {
        m_frag_b(r, P, b, bl);
        mma2(z[P], a, b);
        if (m_lo) mma2(z[P], a, bl);
      }
    // B_f2: (1,0) and (3,2) visible to the first four warps (all warps take part in the
    // block-barriers-only mode, where warps 4-7 are not busy elsewhere)
    mbar::named_sync(2, kOverlap ? 128 : NT);
    if (r == 3) {
      t_frag_a(3, 2, a);
#pragma unroll
      for (int P = 0; P < 2; ++P)
        if (P >= c) {
          m_frag_b(2, P, b, bl);
          mma2(z[P], a, b);
          if (m_lo) mma2(z[P], a, bl);
        }
    }
    float x[2][4] = {};
#pragma unroll
    for (int P = 0; P < 2; ++P)
      if (P >= c) {
        as_a(z[P], a);
        t_frag_b(P, c, b);
        mma2(x, a, b);
      }
    store_neg(r, c, x);
  } else if (!kOverlap) {
    mbar::named_sync(2, NT);
  }
}

}  // namespace chunk_prep_scan
}  // namespace cula
