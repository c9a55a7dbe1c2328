// Block-wide products of fp32 matrices in shared memory on tensor cores (mma.sync m16n8k8 TF32,
// fp32 accumulation, by default 3xTF32 for about fp32's precision; sm_80 and later). For kernels whose operands are fp32 (gradients, states)
// and whose products are small and many: no layout constraints beyond a row pitch, each output
// element handed once to an epilogue functor (store, accumulate, scale, mask).
//
// Ownership: the warp and lane that receive output (i, j) depend only on M, N, NB and the warp
// count, so two calls with the same shape hand each element to the same thread: an accumulating
// second call needs no barrier after the first.
//
// Bank conflicts: a row-major operand read as A (rows i, columns k) or a transposed operand read as
// B is conflict-free with a pitch of 4 mod 32 floats; a row-major B or a transposed A with 8 mod 32.
//
// Precision (template argument P): kThreeTF32, about fp32's; kOneTF32, one TF32 product (operands
// rounded to 10-bit mantissas by an integer add; the tensor core ignores the low 13 bits).
#pragma once

#include <cstdint>

namespace cula {
namespace tf32 {

enum Precision : int { kThreeTF32 = 0, kOneTF32 = 1 };

// d += a b: a 16 x 8 (row), b 8 x 8 (column), d 16 x 8.
__device__ __forceinline__ void mma1688(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element (i, j) of a matrix at p with row pitch ld: p[i ld + j], or p[j ld + i] transposed.
template <bool kTransposed>
struct View {
  const float* p;
  int ld;
  __device__ __forceinline__ float operator()(int i, int j) const { return kTransposed ? p[j * ld + i] : p[i * ld + j]; }
};
__device__ __forceinline__ View<false> rows(const float* p, int ld) { return View<false>{p, ld}; }
__device__ __forceinline__ View<true> cols(const float* p, int ld) { return View<true>{p, ld}; }

// x = hi + lo: the split of 3xTF32 products (hi b_hi + hi b_lo + lo b_hi), about fp32's precision
// at three products' cost. hi is x rounded to TF32 by integer ops (add half a unit of TF32's last
// place to the magnitude's bits, clear the 13 bits below it: round half away from zero, for finite
// x); lo = x - hi is exact in fp32 and goes to the tensor core as it is, which reads a TF32 operand's
// top 19 bits (lo truncated: an error below 2^-21 |x|, with lo_a lo_b, the term 3xTF32 leaves out,
// about 2^-22 |a b|). Three instructions, where cvt.rna.tf32.f32 twice costs about ten: the products'
// operand splits are most of a backward kernel's issued instructions.
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// x rounded to TF32 for one product: half a unit of TF32's last place added to the magnitude's bits;
// the tensor core reads the top 19 bits, so the low 13 need no clearing (as split's hi, one add).
__device__ __forceinline__ uint32_t round_tf32(float x) { return __float_as_uint(x) + 0x1000u; }

// One k-step (8 deep) of the 16 x 8NB tile at (m0, n0), lane (g, t): acc += A B. kPrecise
// (3xTF32): the correction products go to cor, which may be acc itself (one chain) or an
// accumulator of its own (two shorter chains, added at the end).
template <int NB, bool kPrecise, class VA, class VB>
__device__ __forceinline__ void kstep(const VA& a, const VB& b, int m0, int n0, int k0, int g, int t, float (&acc)[NB][4],
                                      float (&cor)[NB][4]) {
  const float ax[4] = {a(m0 + g, k0 + t), a(m0 + g + 8, k0 + t), a(m0 + g, k0 + t + 4), a(m0 + g + 8, k0 + t + 4)};
  uint32_t ah[4], al[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (kPrecise) split(ax[r], ah[r], al[r]);
    else ah[r] = round_tf32(ax[r]);
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int n = n0 + nb * 8 + g;
    const float b0 = b(k0 + t, n), b1 = b(k0 + t + 4, n);
    if (kPrecise) {
      uint32_t h0, l0, h1, l1;
      split(b0, h0, l0);
      split(b1, h1, l1);
      mma1688(cor[nb], al, h0, h1);
      mma1688(cor[nb], ah, l0, l1);
      mma1688(acc[nb], ah, h0, h1);
    } else {
      mma1688(acc[nb], ah, round_tf32(b0), round_tf32(b1));
    }
  }
}

// The k range [k_begin, k_end) of one tile at precision P into acc (cor: 3xTF32's correction chain).
template <int NB, int P, class VA, class VB>
__device__ __forceinline__ void ksteps(const VA& a, const VB& b, int m0, int n0, int k_begin, int k_end, int g, int t,
                                       float (&acc)[NB][4], float (&cor)[NB][4]) {
#pragma unroll 4
  for (int k0 = k_begin; k0 < k_end; k0 += 8) kstep<NB, P == kThreeTF32>(a, b, m0, n0, k0, g, t, acc, cor);
}

// The tile's elements to epi(i, j, value), each once (the mma accumulator layout).
template <int NB, class Epi>
__device__ __forceinline__ void emit(int m0, int n0, int g, int t, const float (&acc)[NB][4], Epi& epi) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int j = n0 + nb * 8 + 2 * t;
    epi(m0 + g, j, acc[nb][0]);
    epi(m0 + g, j + 1, acc[nb][1]);
    epi(m0 + g + 8, j, acc[nb][2]);
    epi(m0 + g + 8, j + 1, acc[nb][3]);
  }
}

// C = A B with A M x KD and B KD x N (views), over NW warps: warp w takes the 16 x 8NB output
// tiles w, w + NW, ...; epi(i, j, value) receives every element of C once. P: the precision.
template <int M, int N, int KD, int NW, int NB = 2, int P = kThreeTF32, class VA, class VB, class Epi>
__device__ __forceinline__ void gemm(const VA a, const VB b, Epi&& epi) {
  static_assert(M % 16 == 0 && N % (8 * NB) == 0 && KD % 8 == 0, "tile multiples");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int TN = N / (8 * NB), TILES = (M / 16) * TN;
  for (int tile = warp; tile < TILES; tile += NW) {
    const int m0 = (tile / TN) * 16, n0 = (tile % TN) * 8 * NB;
    float acc[NB][4], cor[NB][4];  // (the correction chain of its own)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nb][r] = cor[nb][r] = 0.0f;
    ksteps<NB, P>(a, b, m0, n0, 0, KD, g, t, acc, cor);
    if (P == kThreeTF32)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nb][r] += cor[nb][r];
    emit<NB>(m0, n0, g, t, acc, epi);
  }
}

// The k-range split of gemm_wide: the largest power of two at most NW / TILES that divides the k
// steps (1 when the tiles alone fill the warps).
constexpr int split_for(int tiles, int nw, int ksteps) {
  int s = 1;
  while (tiles * s * 2 <= nw && ksteps % (s * 2) == 0) s *= 2;
  return s;
}

// C = A B as gemm, for products with few output tiles (the backward's 16-row block products): 16 x 8
// tiles, and where they number fewer than the warps, the k range split over SPLIT warp groups so
// that every warp works. Group p > 0 leaves its partial sums in scratch ((SPLIT - 1) M N floats);
// after a barrier group 0 adds them in order p = 1, 2, ... (the same sum run after run) and hands
// every element to epi. Every thread of the block calls it (a __syncthreads inside when SPLIT > 1),
// and two calls with no barrier between them need scratch buffers of their own. Ownership as gemm's:
// same shape, same thread.
template <int M, int N, int KD, int NW, int P = kThreeTF32, class VA, class VB, class Epi>
__device__ __forceinline__ void gemm_wide(const VA a, const VB b, float* scratch, Epi&& epi) {
  static_assert(M % 16 == 0 && N % 8 == 0 && KD % 8 == 0, "tile multiples");
  constexpr int TN = N / 8, TILES = (M / 16) * TN, SPLIT = split_for(TILES, NW, KD / 8);
  if constexpr (SPLIT == 1) {
    gemm<M, N, KD, NW, 1, P>(a, b, epi);
  } else {
    constexpr int KS = KD / SPLIT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool active = warp < TILES * SPLIT;
    const int tile = warp % TILES, part = warp / TILES, m0 = (tile / TN) * 16, n0 = (tile % TN) * 8;
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, cor[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (active) {
      ksteps<1, P>(a, b, m0, n0, part * KS, (part + 1) * KS, g, t, acc, cor);
      if (P == kThreeTF32)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[0][r] += cor[0][r];
      if (part > 0) {
        float* s = scratch + (part - 1) * M * N;
        s[(m0 + g) * N + n0 + 2 * t] = acc[0][0];
        s[(m0 + g) * N + n0 + 2 * t + 1] = acc[0][1];
        s[(m0 + g + 8) * N + n0 + 2 * t] = acc[0][2];
        s[(m0 + g + 8) * N + n0 + 2 * t + 1] = acc[0][3];
      }
    }
    __syncthreads();
    if (active && part == 0) {
#pragma unroll
      for (int p = 1; p < SPLIT; ++p) {
        const float* s = scratch + (p - 1) * M * N;
        acc[0][0] += s[(m0 + g) * N + n0 + 2 * t];
        acc[0][1] += s[(m0 + g) * N + n0 + 2 * t + 1];
        acc[0][2] += s[(m0 + g + 8) * N + n0 + 2 * t];
        acc[0][3] += s[(m0 + g + 8) * N + n0 + 2 * t + 1];
      }
      emit<1>(m0, n0, g, t, acc, epi);
    }
  }
}

// The scratch floats gemm_wide needs for a shape.
template <int M, int N, int KD, int NW>
constexpr int wide_scratch() {
  return (split_for((M / 16) * (N / 8), NW, KD / 8) - 1) * M * N;
}

// The same product accumulated in registers across calls: warp w owns tiles w, w + NW, ... (TPW of
// them); v[tile][nb][4] in the mma layout, one chain per tile. drain hands every element to
// epi(i, j, value) once.
template <int M, int N, int NW, int NB = 2>
struct Acc {
  static constexpr int TN = N / (8 * NB), TILES = (M / 16) * TN, TPW = TILES / NW;
  static_assert(M % 16 == 0 && N % (8 * NB) == 0 && TILES % NW == 0, "whole tiles per warp");
  float v[TPW][NB][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) v[u][nb][0] = v[u][nb][1] = v[u][nb][2] = v[u][nb][3] = 0.0f;
  }

  template <int KD, int P = kThreeTF32, class VA, class VB>
  __device__ __forceinline__ void add(const VA a, const VB b) {
    static_assert(KD % 8 == 0, "k steps of 8");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const int tile = warp + u * NW, m0 = (tile / TN) * 16, n0 = (tile % TN) * 8 * NB;
      ksteps<NB, P>(a, b, m0, n0, 0, KD, g, t, v[u], v[u]);
    }
  }

  template <class Epi>
  __device__ __forceinline__ void drain(Epi&& epi) const {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const int tile = warp + u * NW;
      emit<NB>((tile / TN) * 16, (tile % TN) * 8 * NB, g, t, v[u], epi);
    }
  }
};

}  // namespace tf32
}  // namespace cula
