// A block-wide sum in a fixed order, shared by the backwards' kernels.
#pragma once

#include "cuda/kerutils/device_utils.cuh"

namespace cula {
namespace bwd {

// Sum of x over the block's threads, the same order every call (thread count a multiple of 32).
__device__ __forceinline__ float block_sum(float x, float* shm) {
  x = dev::warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
  __syncthreads();  // shm free from an earlier call
  if (lane == 0) shm[warp] = x;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < nw; ++w) s += shm[w];
  return s;
}


}  // namespace bwd
}  // namespace cula
