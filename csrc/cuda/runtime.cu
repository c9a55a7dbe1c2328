// CUDA runtime queries. The runtime is linked statically, so a machine without a driver or GPU
// simply reports zero devices.
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/cuda_ops.h"

namespace cula {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool cuda_device_info(int device, std::string& out) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %d SMs, %zu MiB)", p.name, p.major, p.minor, p.multiProcessorCount,
                static_cast<size_t>(p.totalGlobalMem >> 20));
  out = buf;
  return true;
}

int cuda_device_arch(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

}  // namespace cula
