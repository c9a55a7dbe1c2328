// CUDA backward of every family in recurrent form: see recurrent_bwd.cu for the design.
#pragma once

#include "common/problem.h"

namespace cula {

void cuda_recurrent_bwd(const Recurrence& r, const cula_chunk_bwd_args& a);

}  // namespace cula
