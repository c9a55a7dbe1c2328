// CUDA decode (all families): see decode.cu for the design.
#pragma once

#include "common/error.h"
#include "common/problem.h"

namespace cula {

// The CUDA decode kernel's input rules (contiguity, dtypes, head sizes, alignment, index range):
// the dispatch row's predicate, so the capability answer (cula_decode_explain) states them too.
Refusal cuda_decode_declines(const Recurrence& r, const cula_decode_args& a);
void cuda_decode(const Recurrence& r, const cula_decode_args& a);

}  // namespace cula
