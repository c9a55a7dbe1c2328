// The CUDA runtime as the library sees it: devices, their architecture, SM count and shared memory
// (compiled by nvcc, called from the C ABI and the launchers).
#pragma once

#include <cstdint>
#include <string>

#include "cula/cula.h"

namespace cula {

int cuda_device_count();
bool cuda_device_info(int device, std::string& out);
// Compute capability of the device owning `ptr`'s tensors (major*10+minor), or 0.
int cuda_device_arch(int device);
// Number of SMs of the device (cached); throws the CUDA error where it cannot be read.
int cuda_sm_count(int device);
// Shared memory a block may opt in to on the device, in bytes (cached; throws like cuda_sm_count).
int cuda_smem_per_block(int device);
// The kernels' workspace pool on a device: the most bytes in use at once since the last reset
// (0 without a device or before any use); reset starts a new count.
int64_t cuda_workspace_peak_bytes(int device, bool reset);

}  // namespace cula
