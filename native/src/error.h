// error.h: the runtime's internal error type, the thread-local last error and logging.
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

#include "conduit.h"

namespace conduit {

// Thrown inside the library; api.cpp turns it into a status and the last-error message.
class Error : public std::runtime_error {
  public:
    Error(conduit_status status, const std::string &message) : std::runtime_error(message), status_(status) {}
    conduit_status status() const { return status_; }

  private:
    conduit_status status_;
};

[[noreturn]] void fail(conduit_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define CONDUIT_REQUIRE(cond, ...)                                                                   \
    do {                                                                                             \
        if (!(cond)) ::conduit::fail(CONDUIT_ERR_INVALID_ARGUMENT, __VA_ARGS__);                     \
    } while (0)

void set_last_error(const std::string &message);
void clear_last_error();
const char *last_error();

void log(int32_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

} // namespace conduit
