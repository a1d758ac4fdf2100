// error.cpp: last-error storage and the log sink.
#include "error.h"

#include <cstdio>
#include <mutex>

namespace conduit {
namespace {

thread_local std::string t_last_error;

struct LogSink {
    std::mutex mutex;
    conduit_log_fn fn = nullptr;
    void *user_data = nullptr;
    int32_t min_level = CONDUIT_LOG_WARN;
};

LogSink &sink() {
    static LogSink s;
    return s;
}

std::string vformat(const char *fmt, va_list args) {
    va_list copy;
    va_copy(copy, args);
    const int n = std::vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    std::string out(n > 0 ? size_t(n) : 0, '\0');
    if (n > 0) std::vsnprintf(out.data(), size_t(n) + 1, fmt, args);
    return out;
}

} // namespace

void fail(conduit_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string message = vformat(fmt, args);
    va_end(args);
    throw Error(status, message);
}

void set_last_error(const std::string &message) { t_last_error = message; }
void clear_last_error() { t_last_error.clear(); }
const char *last_error() { return t_last_error.c_str(); }

void log(int32_t level, const char *fmt, ...) {
    LogSink &s = sink();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (level < s.min_level) return;
    va_list args;
    va_start(args, fmt);
    std::string line = vformat(fmt, args);
    va_end(args);
    if (s.fn) {
        s.fn(level, line.c_str(), s.user_data);
    } else {
        static const char *names[] = {"debug", "info", "warn", "error"};
        std::fprintf(stderr, "conduit [%s] %s\n", names[level < 0 ? 0 : (level > 3 ? 3 : level)], line.c_str());
    }
}

} // namespace conduit

extern "C" void conduit_set_log_callback(conduit_log_fn fn, void *user_data, int32_t min_level) {
    conduit::LogSink &s = conduit::sink();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.fn = fn;
    s.user_data = fn ? user_data : nullptr;
    s.min_level = fn ? min_level : CONDUIT_LOG_WARN;
}
