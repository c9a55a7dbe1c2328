// The chunk engines' entries for the dispatch table (sm_80 instruction set and up): chunk_prep_scan/
// (KDA, GDN, GLA) and chunk_fused/ (simple GLA, Lightning); each folder's DESIGN.md has the design.
#pragma once

#include "common/problem.h"

namespace cula {

// Why the tensor-core kernel declines this call (family, gate bound, head sizes, dtypes, alignment,
// device), or nullptr when it takes it: the dispatch table's predicate and the capability answer
// (cula_chunk_fwd_explain). The table falls back to the recurrent kernel when it declines.
const char* chunk_fwd_mma_declines(const Recurrence& r, const cula_chunk_fwd_args& a);
void cuda_chunk_fwd_mma(const Recurrence& r, const cula_chunk_fwd_args& a);
const char* chunk_fwd_fused_declines(const Recurrence& r, const cula_chunk_fwd_args& a);
void cuda_chunk_fwd_fused(const Recurrence& r, const cula_chunk_fwd_args& a);

}  // namespace cula
