// Device utilities of every CUDA kernel: dtype-dispatched loads and stores (DLPack dtype codes of
// the C ABI), programmatic dependent launch, fast exponentials and warp reductions. No host
// headers of the library: only the C ABI's dtype codes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cula/cula.h"

namespace cula {
namespace dev {

__device__ __forceinline__ float ld(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case CULA_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case CULA_FLOAT16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// ld split in two: the raw bits now, the value later (ld_bits then from_bits), so that a load can
// go out early without its conversion stalling the warp right behind it.
__device__ __forceinline__ uint32_t ld_bits(const void* p, int dtype, int64_t i) {
  return dtype == CULA_BFLOAT16 || dtype == CULA_FLOAT16 ? static_cast<const unsigned short*>(p)[i]
                                                         : static_cast<const uint32_t*>(p)[i];
}
__device__ __forceinline__ float from_bits(uint32_t b, int dtype) {
  switch (dtype) {
    case CULA_BFLOAT16: return __uint_as_float(b << 16);
    case CULA_FLOAT16: return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
    default: return __uint_as_float(b);
  }
}

__device__ __forceinline__ void st(void* p, int dtype, int64_t i, float x) {
  switch (dtype) {
    case CULA_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case CULA_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere). A kernel launched with the
// programmatic-serialization attribute may start while the previous kernel of its stream is still
// running: grid_dependency_wait() blocks until that kernel has finished and its writes are
// visible, so it goes before the first read of anything a previous kernel may have written.
// allow_dependents_launch() lets the next such kernel start its launch early.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 2^x by ex2.approx.ftz, one instruction: for arguments already in log2 units.
__device__ __forceinline__ float ex2_ftz(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x));
  return e;
}
// log2(x) by lg2.approx.ftz, one instruction.
__device__ __forceinline__ float lg2_ftz(float x) {
  float l;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(l) : "f"(x));
  return l;
}
// e^x by ex2.approx.ftz: 2 instructions where __expf takes 5 (its path for results below the
// normal range, which this flushes to 0). Identical to __expf wherever e^x is a normal float.
__device__ __forceinline__ float exp_ftz(float x) { return ex2_ftz(x * 1.4426950408889634f); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Warp sums of R per-lane partials (R a power of two <= 32) by reduce-scatter: each step, a lane
// keeps half of its values and adds the partner's copies of them, so the R sums take
// R - 1 + log2(32 / R) shuffles instead of 5 R. On exit lane l holds the sum of x[l / (32 / R)].
template <int R>
__device__ __forceinline__ float warp_sum_scatter(float (&x)[R], int lane) {
  static_assert(R >= 1 && R <= 32 && (R & (R - 1)) == 0, "R is a power of two <= 32");
#pragma unroll
  for (int half = R / 2, off = 16; half >= 1; half /= 2, off /= 2) {
    const bool upper = lane & off;  // this lane keeps values [half, 2 half) of the current range
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float keep = upper ? x[i + half] : x[i], send = upper ? x[i] : x[i + half];
      x[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
#pragma unroll
  for (int off = 16 / R; off > 0; off >>= 1) x[0] += __shfl_xor_sync(0xffffffffu, x[0], off);
  return x[0];
}

// Where warp_sum_scatter<R> leaves its sums: lane l holds sum scatter_index<R>(l); scatter_lane<R>(r)
// is the first of the 32 / R lanes holding sum r, scatter_leader<R>(l) whether l is such a lane.
template <int R>
__device__ __forceinline__ int scatter_index(int lane) { return lane / (32 / R); }
template <int R>
__device__ __forceinline__ int scatter_lane(int r) { return r * (32 / R); }
template <int R>
__device__ __forceinline__ bool scatter_leader(int lane) { return lane % (32 / R) == 0; }

}  // namespace dev
}  // namespace cula
