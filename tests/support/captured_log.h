// psd's warnings while a test's daemon lives: the default logger swapped for one that keeps the
// last 256 lines at warn and above.
#ifndef PSD_TESTS_SUPPORT_CAPTURED_LOG_H_
#define PSD_TESTS_SUPPORT_CAPTURED_LOG_H_

#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace psd::testing {

// Made before the daemon starts, gone after it stops: swapping the default logger is safe only
// while nothing logs.
struct CapturedLog {
  CapturedLog() {
    auto logger = std::make_shared<spdlog::logger>("captured", sink);
    logger->set_level(spdlog::level::warn);
    spdlog::set_default_logger(logger);
  }
  ~CapturedLog() {
    spdlog::set_default_logger(before);
    spdlog::set_level(level);
  }
  CapturedLog(const CapturedLog&) = delete;
  CapturedLog& operator=(const CapturedLog&) = delete;
  bool Has(const std::string& text) const {
    for (const std::string& line : sink->last_formatted()) {
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
  std::shared_ptr<spdlog::logger> before = spdlog::default_logger();
  spdlog::level::level_enum level = spdlog::get_level();
};

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_CAPTURED_LOG_H_
