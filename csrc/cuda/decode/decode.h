// CUDA decode (all families): see decode.cu for the design.
#pragma once

#include "common/problem.h"

namespace cula {

void cuda_decode(const Recurrence& r, const cula_decode_args& a);

}  // namespace cula
