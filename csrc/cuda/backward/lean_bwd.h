// The chunk backward's lean form for the families without the delta rule and one decay per token
// (simple GLA, Lightning), K <= 128: two main kernels and fp32 states (lean_bwd.cu, DESIGN.md).
#pragma once

#include "common/problem.h"

namespace cula {

// Whether cuda_chunk_bwd runs the call in the lean form: no delta rule, a scalar or constant gate,
// K <= 128, the device's shared memory holding its kernels; CULA_BWD_LEAN=0 keeps the general form.
bool lean_form(const Recurrence& r, int device);
// The whole backward in the lean form (the call passed cuda_chunk_bwd_declines and lean_form).
void cuda_lean_bwd(const Recurrence& r, const cula_chunk_bwd_args& a);

}  // namespace cula
