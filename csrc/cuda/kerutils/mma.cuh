// Tensor-core building blocks for the sm_80 path (mma.sync m16n8k16, bf16 or fp16 in, fp32
// accumulate), ldmatrix and cp.async. These run unchanged on sm_90 and sm_100. The element type E of
// pack, unpack and mma16816 is __nv_bfloat16 unless given (__half for engines that read fp16 inputs
// as they are: both operands of a product have one type).
//
// Fragment layouts (lane = 4 * g + t):
//   A 16x16 (row-major m x k): a0 = (m g, k 2t..2t+1), a1 = (m g+8, k 2t..), a2 = (m g, k 2t+8..), a3 = (m g+8, k 2t+8..)
//   B 16x8  (k x n):           b0 = (k 2t..2t+1, n g),  b1 = (k 2t+8.., n g)
//   C 16x8  (m x n):           c0,c1 = (m g, n 2t, 2t+1), c2,c3 = (m g+8, n 2t, 2t+1)
// A C tile pair (n 0..15) converted to bf16 is an A fragment (k 0..15), which chains products in
// registers. The lane address helpers below return the (row, col) of the 16-byte row piece a lane
// hands to ldmatrix.x4 for each storage order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace cula {
namespace mma {

template <class E>
constexpr bool kIsHalf = std::is_same_v<E, __half>;

template <class E = __nv_bfloat16>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (kIsHalf<E>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}
template <class E = __nv_bfloat16>
__device__ __forceinline__ float2 unpack(uint32_t x) {
  if constexpr (kIsHalf<E>) return __half22float2(*reinterpret_cast<const __half2*>(&x));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}

template <class E = __nv_bfloat16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kIsHalf<E>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// (the uint32_t forms take a shared-space address)
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) { ldsm_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// ldmatrix.x4 lane addresses for a 16x16 tile at (row0, col0) of a row-major bf16 array.
// A operand stored [m][k] (non-trans): r = a0..a3.
__device__ __forceinline__ int a_row(int lane) { return lane & 15; }
__device__ __forceinline__ int a_col(int lane) { return (lane >> 4) * 8; }
// A operand stored [k][m] (trans): r = a0..a3.
__device__ __forceinline__ int at_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int at_col(int lane) { return ((lane >> 3) & 1) * 8; }
// B operand stored [n][k] (non-trans): r0,r1 = b0,b1 of n 0..7; r2,r3 = b0,b1 of n 8..15.
__device__ __forceinline__ int bn_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int bn_col(int lane) { return ((lane >> 3) & 1) * 8; }
// B operand stored [k][n] (trans): r0,r1 = b0,b1 of n 0..7; r2,r3 = b0,b1 of n 8..15.
__device__ __forceinline__ int bk_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int bk_col(int lane) { return (lane >> 4) * 8; }

// 16-byte global -> shared copies that bypass L1; the second form takes a shared-space address
// (a base converted once, plus offsets).
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { cp_async16(smem_addr(smem), gmem); }
// 4-byte copies, through L1 (rows whose pitch leaves them unaligned for the 16-byte form).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
// Bulk copies (sm_90+): `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory by the copy engine, completing as transaction bytes on the mbarrier at `bar`
// (mbarrier::complete_tx), so one instruction moves a whole row.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CULA_BULK_COPY 1
#else
#define CULA_BULK_COPY 0
#endif
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
#if CULA_BULK_COPY
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(smem)),
               "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Waits until at most n of this thread's most recent cp.async groups are still in flight (the
// instruction takes an immediate; more than 7 pending waits as for 7, which is only earlier).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

}  // namespace mma
}  // namespace cula
