// CUDA KDA gate activation (FLA's fused_kda_gate): see kda_gate.cu.
#pragma once

#include <cstdint>

#include "cula/cula.h"

namespace cula {

// KDA gate activation on contiguous tensors of one CUDA device.
void cuda_kda_gate(const cula_kda_gate_args& a, int64_t HV, int64_t K);

}  // namespace cula
