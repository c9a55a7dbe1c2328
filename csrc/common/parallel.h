// A minimal parallel-for over [0, n) for the CPU backend.
#pragma once

#include <cstdint>
#include <functional>

namespace cula {

int num_threads();
void set_num_threads(int n);  // 0 = hardware concurrency
// Runs fn(i) for i in [0, n) on up to num_threads() threads; rethrows the first exception.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace cula
