// CUDA backward of every family in recurrent form: see recurrent_bwd.cu for the design.
#pragma once

#include "common/error.h"
#include "common/problem.h"

namespace cula {

// The CUDA backward's input rules (key head sizes; the forward's rules for what it reads in
// place; a contiguous d_final_state): the dispatch row's predicate.
Refusal cuda_recurrent_bwd_declines(const Recurrence& r, const cula_chunk_bwd_args& a);
void cuda_recurrent_bwd(const Recurrence& r, const cula_chunk_bwd_args& a);

}  // namespace cula
