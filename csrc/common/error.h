// Errors: thrown inside the engine, turned into a status + thread-local message at the C ABI.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

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

// Why a dispatch row will not run a call (the table's declines predicates; c_api.cpp). None: the
// row takes it. Prefers: it could, but a later row is better (AUTO moves on; an explicit backend
// still runs it). Unsupported / Argument: it cannot; when no later row takes the call, this is the
// call's error, raised as throw_unsupported or throw_arg would (same status, same message).
struct Refusal {
  enum Kind { None, Prefers, Unsupported, Argument } kind = None;
  std::string argument, expected, given;  // Argument: the three parts; otherwise `given` says why

  static Refusal takes() { return {}; }
  static Refusal prefers(std::string why) { return {Prefers, "", "", std::move(why)}; }
  static Refusal unsupported(std::string why) { return {Unsupported, "", "", std::move(why)}; }
  static Refusal bad_argument(std::string arg, std::string expected, std::string given) {
    return {Argument, std::move(arg), std::move(expected), std::move(given)};
  }
  explicit operator bool() const { return kind != None; }
  // One line for the capability answer (cula_explained_declines).
  std::string reason() const {
    return kind == Argument ? "argument '" + argument + "': expected " + expected + ", got " + given : given;
  }
  [[noreturn]] void raise(const char* entry) const {
    if (kind == Argument) throw_arg(entry, argument, expected, given);
    throw_unsupported(entry, given);
  }
};

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
