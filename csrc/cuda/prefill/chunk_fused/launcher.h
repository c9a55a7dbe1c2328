// The fused chunk engine's entry points below the dispatch table: one launch per head size and
// slice width, each compiled in its own translation unit (instantiations/).
#pragma once

#include <cuda_runtime.h>

#include "common/problem.h"
#include "cuda/common/fwd_params.cuh"

namespace cula {
namespace chunk_fused {

// Workspace, factors, the local pass (nseg > 1) and the fused kernel at head size K and slice
// width VB on the stream (launch.cuh).
template <int K, int VB>
void run(const Recurrence& r, const FwdParams& p, int nseg, int nsub, int device, cudaStream_t stream);

}  // namespace chunk_fused
}  // namespace cula
