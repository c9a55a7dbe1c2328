// The chunk engine's entry points below the dispatch table: one launch per family and head size,
// each compiled in its own translation unit (instantiations/).
#pragma once

#include <cuda_runtime.h>

#include "common/problem.h"
#include "cuda/common/fwd_params.cuh"

namespace cula {
namespace chunk_prep_scan {

struct Kda;
struct Gdn;
struct Gla;

// Workspace, prep and scan of family F at head size K on the stream (launch.cuh); block_barriers_only
// runs the debug instantiation whose named barriers are block barriers (for racecheck).
template <int K, class F>
void run_vb(const Recurrence& r, const FwdParams& p, int device, cudaStream_t stream, bool block_barriers_only);

}  // namespace chunk_prep_scan
}  // namespace cula
