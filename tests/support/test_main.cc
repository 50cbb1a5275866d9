// Catch2 main for psd's tests: the daemon's logging is kept to errors so test output stays
// readable; expected warnings (disconnects, refused frames) are what the tests provoke.
#define CATCH_CONFIG_RUNNER
#include <spdlog/spdlog.h>

#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  spdlog::set_level(spdlog::level::err);
  return Catch::Session().run(argc, argv);
}
