// Warpgroup tensor-core products (sm_90a: wgmma.mma_async), for operands that four warps would
// otherwise each read from shared memory on their own. CULA_WGMMA is 1 in the sm_90a device pass
// only; every other pass (host, sm_80, sm_100a) keeps the mma.sync path, so callers branch on it
// with `if constexpr`.
//
// Operands are K-major bf16 tiles in the 128-byte swizzle: a tile of R rows and C columns (C a
// multiple of 64) is C / 64 column panels of R rows x 128 bytes, one after the other; in a panel,
// row r's 16-byte piece j sits at piece j ^ (r % 8). Panels start on 1024-byte boundaries (the
// swizzle repeats every 8 rows of 128 bytes). sw128_offset gives an element's byte offset; one
// k-step of 16 columns is 32 bytes into the panel, which the descriptor's start address takes as
// it is (the hardware applies the swizzle to the address bits).
// Accumulators: a warpgroup's m64nN result is, per warp w of the group, rows 16w..16w+15 in the
// mma.sync C-fragment layout of N / 8 tiles of 16 x 8 (d[j][0..3] = tile j's c0..c3), so the
// callers' register arrays are those of the mma.sync path.
#pragma once

#include <cstdint>

#include "cuda/kerutils/mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CULA_WGMMA 1
#else
#define CULA_WGMMA 0
#endif

namespace cula {
namespace wg {

// Byte offset of element (row, col) in a K-major 128-byte-swizzled tile of `rows` rows.
__host__ __device__ constexpr int sw128_offset(int rows, int row, int col) {
  return (col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) << 4) + (col % 8) * 2;
}

// Shared-memory matrix descriptor of a K-major 128-byte-swizzled operand starting at smem address
// addr: 8-row groups 1024 bytes apart (the stride field), the leading-dimension field unused.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Descriptor of k-step kk (16 columns) of such a tile of `rows` rows at shared address tile, from
// row row0 (a multiple of 8, so the swizzle phase is the tile's): the step is 32 bytes into column
// panel kk / 4 (sw128_offset(rows, row0, 16 kk), written without its XOR, which is 0 there).
__device__ __forceinline__ uint64_t desc_kstep(uint32_t tile, int rows, int row0, int kk) {
  return desc_sw128(tile + (kk / 4) * rows * 128 + row0 * 128 + (kk % 4) * 32);
}

// Descriptor of k-step kk (16 rows of K) of an MN-major operand: a tile laid out as sw128_offset's
// with its rows along K and its columns along M (or N), so that a row-major matrix whose rows run
// over K is staged as it lies; columns from mn0 (a multiple of 64) span 64 elements of M or N. The
// wgmma's transpose flag for the operand is 1. Leading byte offset: the next 64 columns' panel; stride
// byte offset: the next 8 rows of K (1024 bytes).
__device__ __forceinline__ uint64_t desc_mn(uint32_t tile, int rows, int kk, int mn0) {
  const uint32_t addr = tile + (mn0 / 64) * rows * 128 + kk * 16 * 128;
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((rows * 128) >> 4) << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void fence() {
#if CULA_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if CULA_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most N of this warpgroup's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_pending() {
#if CULA_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void wait_all() { wait_pending<0>(); }
// Generic-proxy writes to shared memory (thread stores, cp.async) made visible to the async proxy
// that wgmma reads operands through; each writing thread runs it before the barrier.
__device__ __forceinline__ void fence_proxy_async() {
#if CULA_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous product.
template <int NT>
__device__ __forceinline__ void fence_operand(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+f"(d[j][r])::"memory");
}

// d += A B^T over one k-step of 16: A 64 x 16 and B N x 16, both K-major (descriptors above).
template <int NT>
__device__ __forceinline__ void mma_bf16(float (&d)[NT][4], uint64_t da, uint64_t db);

// d += op(A) op(B) over one k-step of 16 with N = 16, op as for mma_bf16_n64 below.
template <int TA, int TB>
__device__ __forceinline__ void mma_bf16_n16(float (&d)[2][4], uint64_t da, uint64_t db) {
#if CULA_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, %11, %12;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3])
      : "l"(da), "l"(db), "n"(1), "n"(TA), "n"(TB));
#endif
}

template <>
__device__ __forceinline__ void mma_bf16<2>(float (&d)[2][4], uint64_t da, uint64_t db) {
  mma_bf16_n16<0, 0>(d, da, db);
}

// d += op(A) op(B) over one k-step of 16 with N = 32, op as for mma_bf16_n64 below.
template <int TA, int TB>
__device__ __forceinline__ void mma_bf16_n32(float (&d)[4][4], uint64_t da, uint64_t db) {
#if CULA_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "n"(1), "n"(TA), "n"(TB));
#endif
}

template <>
__device__ __forceinline__ void mma_bf16<4>(float (&d)[4][4], uint64_t da, uint64_t db) {
  mma_bf16_n32<0, 0>(d, da, db);
}

// d += op(A) op(B) over one k-step of 16 with N = 64: op transposes an operand whose flag is 1
// (MN-major, desc_mn), else it is K-major (desc_kstep).
template <int TA, int TB>
__device__ __forceinline__ void mma_bf16_n64(float (&d)[8][4], uint64_t da, uint64_t db) {
#if CULA_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "n"(1), "n"(TA), "n"(TB));
#endif
}

// Four 8x8 bf16 matrices (a warp's C fragments packed to bf16, r[i] for matrix i) stored
// transposed; lane l gives the address of row l % 8 of matrix l / 8 as stored.
__device__ __forceinline__ void stsm_x4_t(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if CULA_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
#endif
}

// A warp's C fragments of a 16 x 8NT block (fragment rows r0.., columns c0..) stored transposed:
// element (r, c) at row c, column r of a K-major 128-byte-swizzled tile of `rows` rows at shared
// address base (one stmatrix.trans per 16 x 16).
template <int NT>
__device__ __forceinline__ void store_t_sw128(uint32_t base, int rows, int r0, int c0, const float (&d)[NT][4],
                                              int lane) {
  const int m = lane >> 3, j = lane & 7;
#pragma unroll
  for (int np = 0; np < NT / 2; ++np)
    stsm_x4_t(base + sw128_offset(rows, c0 + (2 * np + (m >> 1)) * 8 + j, r0 + 8 * (m & 1)),
              mma::pack(d[2 * np][0], d[2 * np][1]), mma::pack(d[2 * np][2], d[2 * np][3]),
              mma::pack(d[2 * np + 1][0], d[2 * np + 1][1]), mma::pack(d[2 * np + 1][2], d[2 * np + 1][3]));
}

}  // namespace wg
}  // namespace cula
