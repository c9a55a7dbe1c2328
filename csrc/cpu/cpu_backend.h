// The fast CPU backend (float32, multi-threaded).
#pragma once

#include "common/problem.h"

namespace cula {

void cpu_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);
void cpu_decode(const Recurrence& r, const cula_decode_args& a);
void cpu_kda_gate(const cula_kda_gate_args& a, const cula_tensor& g, int64_t HV, int64_t K);
const char* cpu_isa();  // "avx2+fma" or "baseline": the build of the CPU kernels in use

}  // namespace cula
