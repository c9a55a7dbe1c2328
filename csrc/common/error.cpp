#include "common/error.h"

namespace cula {

namespace {
thread_local std::string g_last_error;
}

void throw_arg(const char* entry, const std::string& arg, const std::string& expected, const std::string& given) {
  throw Error(CULA_ERROR_INVALID_ARGUMENT,
              std::string(entry) + ": argument '" + arg + "': expected " + expected + ", got " + given);
}

void throw_unsupported(const char* entry, const std::string& what) {
  throw Error(CULA_ERROR_UNSUPPORTED, std::string(entry) + ": " + what);
}

void set_last_error(const std::string& msg) { g_last_error = msg; }
void clear_last_error() { g_last_error.clear(); }
const char* last_error() { return g_last_error.c_str(); }

}  // namespace cula
