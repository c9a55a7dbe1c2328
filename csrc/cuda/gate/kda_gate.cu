// KDA gate activation kernel (FLA's fused_kda_gate): one thread per element of g, grid-stride.
// An op of its own: the forward and decode kernels activate their gates in-kernel (recurrence_math.cuh).
//   no lower bound: a = -exp(A_log[h]) * softplus(g + dt_bias[h, k])   (softplus = x above 20)
//   lower bound lb: a = lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h, k]))  (A_log optional)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "cuda/runtime/check.h"
#include "cuda/common/recurrence_math.cuh"
#include "cuda/gate/kda_gate.h"
#include "cuda/runtime/runtime.h"

namespace cula {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

template <typename Tin, typename Tout>
__global__ void kda_gate_kernel(const Tin* __restrict__ g, const float* __restrict__ A_log,
                                const float* __restrict__ dt_bias, Tout* __restrict__ out, int64_t n, int HV, int K,
                                int has_lb, float lb) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int k = static_cast<int>(i % K);
    const int h = static_cast<int>((i / K) % HV);
    float x = to_float(g[i]);
    if (dt_bias) x += dt_bias[h * K + k];
    const float eA = A_log ? expf(A_log[h]) : 1.0f;
    out[i] = from_float<Tout>(dev::activate_gate_precise(x, eA, has_lb, lb));
  }
}

void check(cudaError_t e, const char* what) { cuda_check(e, "kda_gate", what); }

template <typename Tin, typename Tout>
void launch(const cula_kda_gate_args& a, int64_t n, int64_t HV, int64_t K) {
  check(cudaSetDevice(a.g->device_id), "cudaSetDevice");
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
  if (n == 0) return;
  kda_gate_kernel<Tin, Tout><<<static_cast<unsigned>(blocks), threads, 0, static_cast<cudaStream_t>(a.opt.stream)>>>(
      static_cast<const Tin*>(a.g->data), a.A_log ? static_cast<const float*>(a.A_log->data) : nullptr,
      a.dt_bias ? static_cast<const float*>(a.dt_bias->data) : nullptr, static_cast<Tout*>(a.g_out->data), n,
      static_cast<int>(HV), static_cast<int>(K), a.opt.has_lower_bound, static_cast<float>(a.opt.lower_bound));
  check(cudaGetLastError(), "kernel launch");
}

template <typename Tin>
void launch_out(const cula_kda_gate_args& a, int64_t n, int64_t HV, int64_t K) {
  if (a.g_out->dtype == CULA_FLOAT32)
    launch<Tin, float>(a, n, HV, K);
  else
    launch<Tin, __nv_bfloat16>(a, n, HV, K);
}

}  // namespace

void cuda_kda_gate(const cula_kda_gate_args& a, int64_t HV, int64_t K) {
  int64_t n = 1;
  for (int i = 0; i < a.g->ndim; ++i) n *= a.g->shape[i];
  switch (a.g->dtype) {
    case CULA_FLOAT32: launch_out<float>(a, n, HV, K); break;
    case CULA_BFLOAT16: launch_out<__nv_bfloat16>(a, n, HV, K); break;
    case CULA_FLOAT16: launch_out<__half>(a, n, HV, K); break;
    default: throw_unsupported("kda_gate", "the CUDA kernel takes g in float32, bfloat16 or float16");
  }
}

}  // namespace cula
