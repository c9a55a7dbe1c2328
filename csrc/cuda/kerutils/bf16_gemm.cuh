// Block-wide products of bf16 tiles in shared memory on tensor cores (mma.sync m16n8k16, fp32
// accumulation, operands by ldmatrix; sm_80 and later): tf32_gemm.cuh's register accumulators for
// operands that are already bf16, at a quarter of its shared-memory loads (one ldmatrix.x4 carries
// a 16 x 16 operand block where the fp32 path loads every element).
//
// A tile is bf16, row pitch ld elements; ld * 2 bytes an odd multiple of 16 (ld = width + 8 for
// widths that are multiples of 64) keeps the eight rows of each ldmatrix in distinct banks. An
// operand is K-major (its k index contiguous: A stored [m][k], B stored [n][k]) or MN-major (A stored
// [k][m], B stored [k][n]); MN-major operands load through ldmatrix.trans, so a product reads any
// tile as it lies, transposed or not.
//
// Ownership as tf32::Acc: warp w owns output tiles w, w + NW, ... (16 x 8 NB each), so two
// accumulators of one shape hand an element to the same thread.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kerutils/mma.cuh"

namespace cula {
namespace bf16mm {

template <bool kMN>
struct Tile {
  const __nv_bfloat16* p;
  int ld;
};
__device__ __forceinline__ Tile<false> kmajor(const __nv_bfloat16* p, int ld) { return {p, ld}; }
__device__ __forceinline__ Tile<true> mnmajor(const __nv_bfloat16* p, int ld) { return {p, ld}; }

template <int M, int N, int NW, int NB = 2>
struct Acc {
  static constexpr int TN = N / (8 * NB), TILES = (M / 16) * TN, TPW = TILES / NW;
  static_assert(NB % 2 == 0 && M % 16 == 0 && N % (8 * NB) == 0 && TILES % NW == 0, "whole tiles per warp");
  float v[TPW][NB][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) v[u][nb][0] = v[u][nb][1] = v[u][nb][2] = v[u][nb][3] = 0.0f;
  }
  __device__ __forceinline__ static void origin(int u, int& m0, int& n0) {
    const int tile = static_cast<int>(threadIdx.x >> 5) + u * NW;
    m0 = (tile / TN) * 16, n0 = (tile % TN) * 8 * NB;
  }

  // += A B over k in [0, KD)
  template <int KD, bool AM, bool BM>
  __device__ __forceinline__ void add(const Tile<AM> a, const Tile<BM> b) {
    static_assert(KD % 16 == 0, "k steps of 16");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      int m0, n0;
      origin(u, m0, n0);
#pragma unroll 4
      for (int k0 = 0; k0 < KD; k0 += 16) {
        uint32_t af[4];
        if (AM) mma::ldsm_x4_t(af, a.p + (k0 + mma::at_row(lane)) * a.ld + m0 + mma::at_col(lane));
        else mma::ldsm_x4(af, a.p + (m0 + mma::a_row(lane)) * a.ld + k0 + mma::a_col(lane));
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
          uint32_t bf[4];
          if (BM) mma::ldsm_x4_t(bf, b.p + (k0 + mma::bk_row(lane)) * b.ld + n0 + 8 * nb + mma::bk_col(lane));
          else mma::ldsm_x4(bf, b.p + (n0 + 8 * nb + mma::bn_row(lane)) * b.ld + k0 + mma::bn_col(lane));
          mma::mma16816(v[u][nb], af, bf[0], bf[1]);
          mma::mma16816(v[u][nb + 1], af, bf[2], bf[3]);
        }
      }
    }
  }

  // v += s[row] o.v (o: an accumulator of the same shape)
  __device__ __forceinline__ void add_rows_scaled(const Acc& o, const float* s) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      int m0, n0;
      origin(u, m0, n0);
      const float s0 = s[m0 + g], s1 = s[m0 + g + 8];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        v[u][nb][0] += s0 * o.v[u][nb][0], v[u][nb][1] += s0 * o.v[u][nb][1];
        v[u][nb][2] += s1 * o.v[u][nb][2], v[u][nb][3] += s1 * o.v[u][nb][3];
      }
    }
  }

  // every element once, as pairs, to read or write: f(i, j, x_ij, x_i,j+1) (j even, both by reference)
  template <class F>
  __device__ __forceinline__ void each(F&& f) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      int m0, n0;
      origin(u, m0, n0);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int j = n0 + 8 * nb + 2 * t;
        f(m0 + g, j, v[u][nb][0], v[u][nb][1]);
        f(m0 + g + 8, j, v[u][nb][2], v[u][nb][3]);
      }
    }
  }

  // every element once, as pairs: epi(i, j, x_ij, x_i,j+1) (j even)
  template <class Epi>
  __device__ __forceinline__ void drain(Epi&& epi) {
    each([&](int i, int j, float& x0, float& x1) { epi(i, j, x0, x1); });
  }
};

}  // namespace bf16mm
}  // namespace cula
