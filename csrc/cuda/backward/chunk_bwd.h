// CUDA backward in chunk form (tensor cores): see chunk_bwd.cu and DESIGN.md beside it.
#pragma once

#include "common/error.h"
#include "common/problem.h"

namespace cula {

// Why the chunk form leaves a call to the recurrent kernel (key head sizes, what the forward's
// chunk engines take): a preference, never an error; the recurrent row states the input rules.
Refusal cuda_chunk_bwd_declines(const Recurrence& r, const cula_chunk_bwd_args& a);
void cuda_chunk_bwd(const Recurrence& r, const cula_chunk_bwd_args& a);

}  // namespace cula
