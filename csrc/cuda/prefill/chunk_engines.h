// The chunk engines' entries for the dispatch table (sm_80 instruction set and up): chunk_prep_scan/
// (KDA, GDN, GLA) and chunk_fused/ (simple GLA, Lightning); each folder's DESIGN.md has the design.
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
