// A CUDA runtime status as the library's error: "<op>: <what>: <CUDA's message>".
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/error.h"

namespace cula {

inline void cuda_check(cudaError_t e, const char* op, const char* what) {
  if (e != cudaSuccess) throw Error(CULA_ERROR_CUDA, std::string(op) + ": " + what + ": " + cudaGetErrorString(e));
}

}  // namespace cula
