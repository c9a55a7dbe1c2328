// Chunked forward on tensor cores (sm_80 instruction set): see chunk_fwd_mma.cu (families with the
// delta rule) and chunk_fwd_fused.cu (without it, scalar or constant decay) for the designs.
#pragma once

#include "common/problem.h"

namespace cula {

// Whether the tensor-core kernel takes this call (family, gate bound, head sizes, dtypes,
// alignment, device); the dispatch table falls back to the recurrent kernel otherwise.
bool chunk_fwd_mma_accepts(const Recurrence& r, const cula_chunk_fwd_args& a);
void cuda_chunk_fwd_mma(const Recurrence& r, const cula_chunk_fwd_args& a);
bool chunk_fwd_fused_accepts(const Recurrence& r, const cula_chunk_fwd_args& a);
void cuda_chunk_fwd_fused(const Recurrence& r, const cula_chunk_fwd_args& a);

}  // namespace cula
