// CUDA forward of every family in recurrent form: see recurrent_fwd.cu for the design.
#pragma once

#include "common/error.h"
#include "common/problem.h"

namespace cula {

// The recurrent kernel's input rules (key head sizes; inputs it reads in place): the dispatch
// row's predicate.
Refusal cuda_recurrent_fwd_declines(const Recurrence& r, const cula_chunk_fwd_args& a);
void cuda_recurrent_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);

}  // namespace cula
