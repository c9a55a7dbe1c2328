// CUDA runtime queries. The runtime is linked statically, so a machine without a driver or GPU
// simply reports zero devices.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "cuda/runtime/check.h"
#include "cuda/runtime/runtime.h"

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

namespace {

// Attributes fixed for the life of the process, cached per device: the launchers ask for them on
// every call (a runtime call each, ~1 us of host time). 0 = not asked yet (or no such device).
constexpr int kMaxDevices = 64;
std::atomic<int> arch_cache[kMaxDevices];
std::atomic<int> sm_cache[kMaxDevices];
std::atomic<int> smem_cache[kMaxDevices];

int cached_attribute(std::atomic<int>* cache, int device, int (*query)(int)) {
  if (device < 0 || device >= kMaxDevices) return query(device);
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) cache[device].store(v = query(device), std::memory_order_relaxed);
  return v;
}

int query_arch(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

int query_sm_count(int device) {
  int n = 0;
  cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "CUDA", "multiprocessor count");
  return n;
}

int query_smem_per_block(int device) {
  int n = 0;
  cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "CUDA",
             "shared memory per block");
  return n;
}

}  // namespace

int cuda_device_arch(int device) { return cached_attribute(arch_cache, device, query_arch); }

int cuda_sm_count(int device) { return cached_attribute(sm_cache, device, query_sm_count); }

int cuda_smem_per_block(int device) {
  const int n = cached_attribute(smem_cache, device, query_smem_per_block);
  // CULA_MAX_SMEM_PER_BLOCK caps it (bytes): the kernels then plan as on a device with less shared
  // memory (e.g. 166912 for an A100), so those paths are testable on a larger one. Read per call.
  if (const char* cap = std::getenv("CULA_MAX_SMEM_PER_BLOCK")) {
    const long v = std::strtol(cap, nullptr, 10);
    if (v > 0 && v < n) return static_cast<int>(v);
  }
  return n;
}

}  // namespace cula
