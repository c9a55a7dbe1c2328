// CUDA forward of every family in recurrent form: see recurrent_fwd.cu for the design.
#pragma once

#include "common/problem.h"

namespace cula {

void cuda_recurrent_fwd(const Recurrence& r, const cula_chunk_fwd_args& a);

}  // namespace cula
