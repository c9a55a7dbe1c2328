// The carried-state correction of context parallelism (cula_cp_correct): see cp_correct.cu.
#pragma once

#include "common/error.h"
#include "common/problem.h"

namespace cula {

Refusal cuda_cp_correct_declines(const CpCorrectShape& s, const cula_cp_correct_args& a);
void cuda_cp_correct(const CpCorrectShape& s, const cula_cp_correct_args& a);
// The host row (float64 sums): the CPU backend and the reference.
void host_cp_correct(const CpCorrectShape& s, const cula_cp_correct_args& a);

}  // namespace cula
