// fp16 inputs of the tensor-core chunk engines: they compute on bf16 tiles (their intermediates are
// bf16 either way), so fp16 q, k, v are turned into bf16 where they land in shared memory, 16 bytes
// at a time, and the output is written back as fp16 (pack_out). Two 16-bit values of either type
// from global memory: ld2. The output may also be fp32 (store_out2): the accumulators unrounded,
// for callers that add to o before rounding it (context parallelism's carried-state correction).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kerutils/mma.cuh"

namespace cula {
namespace chunk {

__device__ __forceinline__ uint4 half8_to_bf16(uint4 v) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
    w[j] = mma::pack(f.x, f.y);
  }
  return v;
}
__device__ __forceinline__ void half8_to_bf16_at(void* p) {
  *reinterpret_cast<uint4*>(p) = half8_to_bf16(*reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ float2 ld2(const void* p, bool half) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
  return half ? __half22float2(*reinterpret_cast<const __half2*>(&w)) : mma::unpack(w);
}
// Two 16-bit values in a register, fp16 (kHalf) or bf16, as floats: for loops compiled once per type.
template <bool kHalf>
__device__ __forceinline__ float2 unpack16(uint32_t w) {
  if constexpr (kHalf) return __half22float2(*reinterpret_cast<const __half2*>(&w));
  else return mma::unpack(w);
}
__device__ __forceinline__ uint32_t pack_out(float a, float b, bool half) {
  if (!half) return mma::pack(a, b);
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two adjacent outputs at element offset off (even) of out: fp32, else 16-bit (fp16 when half).
__device__ __forceinline__ void store_out2(void* out, bool f32, bool half, int64_t off, float a, float b) {
  if (f32) *reinterpret_cast<float2*>(static_cast<float*>(out) + off) = make_float2(a, b);
  else *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + off) = pack_out(a, b, half);
}

}  // namespace chunk
}  // namespace cula
