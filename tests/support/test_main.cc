// Catch2 main for psd's tests: the daemon's logging is kept to errors so test output stays
// readable; expected warnings (disconnects, refused frames) are what the tests provoke.
// PSD_TEST_LOG=info (or debug, warn...) shows more when a test is looked into.
#define CATCH_CONFIG_RUNNER
#include <spdlog/spdlog.h>

#include <catch2/catch.hpp>
#include <cstdlib>

int main(int argc, char* argv[]) {
  const char* level = std::getenv("PSD_TEST_LOG");
  spdlog::set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::err);
  return Catch::Session().run(argc, argv);
}
