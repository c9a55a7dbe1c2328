// The float64 reference implementation (the test oracle for every op).
#pragma once

#include "common/problem.h"

namespace cula {

void reference_chunk_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);
void reference_decode(const Recurrence& r, const cula_decode_args& a);
void reference_chunk_bwd(const Recurrence& r, const cula_chunk_bwd_args& a);

}  // namespace cula
