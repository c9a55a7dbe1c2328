// Errors: thrown inside the engine, turned into a status + thread-local message at the C ABI.
#pragma once

#include <stdexcept>
#include <string>

#include "cula/cula.h"

namespace cula {

class Error : public std::runtime_error {
 public:
  Error(cula_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  cula_status status() const { return status_; }

 private:
  cula_status status_;
};

// "<entry>: argument '<arg>': expected <expected>, got <given>"
[[noreturn]] void throw_arg(const char* entry, const std::string& arg, const std::string& expected,
                            const std::string& given);
[[noreturn]] void throw_unsupported(const char* entry, const std::string& what);

void set_last_error(const std::string& msg);
void clear_last_error();
const char* last_error();

// Runs fn, mapping exceptions to statuses and the last-error message.
template <typename Fn>
cula_status guarded(Fn&& fn) {
  try {
    clear_last_error();
    fn();
    return CULA_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return CULA_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    set_last_error(std::string("internal error: ") + e.what());
    return CULA_ERROR_INTERNAL;
  }
}

}  // namespace cula
