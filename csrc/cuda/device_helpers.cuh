// Device helpers shared by the CUDA kernels: dtype-dispatched loads/stores and warp reductions.
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

__device__ __forceinline__ void st(void* p, int dtype, int64_t i, float x) {
  switch (dtype) {
    case CULA_BFLOAT16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    case CULA_FLOAT16: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(p)[i] = x;
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace dev
}  // namespace cula
