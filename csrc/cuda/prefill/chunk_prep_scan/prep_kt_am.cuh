// Stages of the prep kernel after Minv: Kt = Minv^T Kd and AM = tril(A_qk) Minv, both to the
// workspace block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kerutils/mma.cuh"
#include "cuda/prefill/chunk_prep_scan/config.cuh"
#include "cuda/prefill/chunk_prep_scan/prep_common.cuh"

namespace cula {
namespace chunk_prep_scan {

// Kt = Minv^T Kd (Kd in the k tile), written transposed: Kt^T = Kd^T Minv, [channel][token], the
// A operand of the scan's state update as it reads it (K-major). Each warp its 16-channel tiles:
// token block Jb of Kt^T = sum_{Ib >= Jb} (Kd_Ib)^T Minv_{Ib,Jb}, Kd^T as A fragments (ldmatrix
// .trans of the k tile), the ten Minv blocks as B fragments loaded once.
// t_s: Minv (bf16, row stride Ly::LDT); ck_s: Kd (row stride Ly::LDK); kto: the workspace's Kt.
// kd_lo (GDN with fp16 inputs): kto holds Kd's second bf16 plane, transposed as Kt^T is; each warp
// reads the planes of its channel tiles into A fragments before it writes their Kt over them.
template <int K, int NW, class Ly>
__device__ __forceinline__ void kt_product(const bf16* t_s, const bf16* ck_s, bf16* kto, bool kd_lo, int warp, int lane, int g, int t) {
  constexpr int LDK = Ly::LDK, LDT = Ly::LDT;
  if (16 * NW <= K || 16 * warp < K) {  // (8 warps at K = 64: four idle)
    constexpr int KT = cmax(1, K / (16 * NW));  // 16-channel tiles per warp
    uint32_t mb[4][4][4];  // Minv block (Ib, Jb), Jb <= Ib, as the B operand [token i][token j]
#pragma unroll
    for (int Ib = 0; Ib < 4; ++Ib)
#pragma unroll
      for (int Jb = 0; Jb <= Ib; ++Jb)
        mma::ldsm_x4_t(mb[Ib][Jb], t_s + (16 * Ib + mma::bk_row(lane)) * LDT + 16 * Jb + mma::bk_col(lane));
#pragma unroll 1
    for (int c0 = 16 * KT * warp, c1 = c0 + 16 * KT; c0 < c1; c0 += 16) {
      float acc[4][2][4] = {};
#pragma unroll
      for (int Ib = 0; Ib < 4; ++Ib) {
        uint32_t a[4];
        mma::ldsm_x4_t(a, ck_s + (16 * Ib + mma::at_row(lane)) * LDK + c0 + mma::at_col(lane));
#pragma unroll
        for (int Jb = 0; Jb <= Ib; ++Jb) {
          mma::mma16816(acc[Jb][0], a, mb[Ib][Jb][0], mb[Ib][Jb][1]);
          mma::mma16816(acc[Jb][1], a, mb[Ib][Jb][2], mb[Ib][Jb][3]);
        }
        if (kd_lo) {  // A [channel][token] from the transposed plane, as the fragment lays it out
          const bf16* lo = kto + (c0 + g) * kBT + 16 * Ib + 2 * t;
          a[0] = __ldcg(reinterpret_cast<const unsigned*>(lo));
          a[1] = __ldcg(reinterpret_cast<const unsigned*>(lo + 8 * kBT));
          a[2] = __ldcg(reinterpret_cast<const unsigned*>(lo + 8));
          a[3] = __ldcg(reinterpret_cast<const unsigned*>(lo + 8 * kBT + 8));
#pragma unroll
          for (int Jb = 0; Jb <= Ib; ++Jb) {
            mma::mma16816(acc[Jb][0], a, mb[Ib][Jb][0], mb[Ib][Jb][1]);
            mma::mma16816(acc[Jb][1], a, mb[Ib][Jb][2], mb[Ib][Jb][3]);
          }
        }
      }
      if (kd_lo) __syncwarp();  // every lane's planes read before Kt goes over them
#pragma unroll
      for (int Jb = 0; Jb < 4; ++Jb)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            u32at(kto + (c0 + g + 8 * hh) * kBT + 16 * Jb + 8 * nt + 2 * t) = pack(acc[Jb][nt][2 * hh], acc[Jb][nt][2 * hh + 1]);
    }
  }
}

// Vnew = U + W S = Minv Y with Y = beta v + W' S, W' = -beta k e^G (the scan forms Y from v read
// from the input), so the intra-chunk part of o is A Vnew = (tril(A_qk) Minv) Y and the state
// update Kd^T Vnew = Kt^T Y with Kt = Minv^T Kd (GDN: Kd = diag(ks e^{G_last - G}) k): no U, W
// products here and no v tile.
// AM = tril(A_qk) Minv, block (Ib, Cb) = sum_{Jb=Cb..Ib} A_{Ib,Jb} Minv_{Jb,Cb}; the ten lower
// block pairs dealt as for the pair products (4-6 k-steps per warp); A from fp32 as bf16 hi + lo
// for the diagonal blocks, which come out as hi + lo, and as bf16 for those below the diagonal,
// which come out as one bf16 plane.
// (8 warps: the pairs dealt by cost, Ib - Cb + 1 steps: (3,0); (2,0); (3,1); (1,0); (2,1) and
// (1,1); (3,2) and (2,2); (3,3); (0,0), as pair numbers in two nibble tables)
// pi, pj: this warp's lower block pairs (as dealt for the pair products); af_s: tril(A_qk) in fp32
// (row stride Ly::MS); amo: the workspace's A planes.
template <int KH, int QP, class Ly, class Wk>
__device__ __forceinline__ void am_product(const int (&pi)[QP], const int (&pj)[QP], const float* af_s, const bf16* t_s,
                                           bf16* amo, int warp, int lane, int g, int t) {
  constexpr int MS = Ly::MS, LDT = Ly::LDT;
#pragma unroll
  for (int q = 0; q < (KH == 2 ? 2 : 3); ++q) {
    int Ib = pi[q], Cb = pj[q];
    if (KH == 2) pair_of(((q == 0 ? 0x09841736u : 0xFF52FFFFu) >> (4 * warp)) & 15, Ib, Cb);
    if (Ib < 0) continue;
    float acc[2][4] = {};
    // A's lo part only where the output keeps a lo plane (the diagonal blocks, one k-step): a block
    // written as one bf16 plane is rounded to bf16 anyway
    const bool a_lo = Wk::kAPlanes == 2 && Ib == Cb;
    for (int Jb = Cb; Jb <= Ib; ++Jb) {
      uint32_t ah[4], al[4], b[4];
#pragma unroll
      for (int rr = 0; rr < 4; ++rr) {
        const float2 x = *reinterpret_cast<const float2*>(af_s + (16 * Ib + g + 8 * (rr & 1)) * MS + 16 * Jb + 2 * t + 8 * (rr >> 1));
        ah[rr] = pack(x.x, x.y);
        const float2 h2 = unpack(ah[rr]);
        al[rr] = pack(x.x - h2.x, x.y - h2.y);
      }
      mma::ldsm_x4_t(b, t_s + (16 * Jb + mma::bk_row(lane)) * LDT + 16 * Cb + mma::bk_col(lane));
      mma::mma16816(acc[0], ah, b[0], b[1]);
      mma::mma16816(acc[1], ah, b[2], b[3]);
      if (a_lo) {
        mma::mma16816(acc[0], al, b[0], b[1]);
        mma::mma16816(acc[1], al, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int at = (16 * Ib + g + 8 * hh) * kBT + 16 * Cb + nt * 8 + 2 * t;
        const uint32_t hi = pack(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
        u32at(amo + at) = hi;
        if (a_lo) {  // the lo plane (a diagonal block)
          const float2 h2 = unpack(hi);
          u32at(amo + kBT * kBT + at) = pack(acc[nt][2 * hh] - h2.x, acc[nt][2 * hh + 1] - h2.y);
        }
      }
  }
}

}  // namespace chunk_prep_scan
}  // namespace cula
