// Eventually: polls a condition psd reaches by itself, for at most 60 s. The bound is the test's
// (a hang fails it instead of stopping CI), never a timing assertion.
#ifndef PSD_TESTS_SUPPORT_EVENTUALLY_H_
#define PSD_TESTS_SUPPORT_EVENTUALLY_H_

#include <chrono>
#include <thread>

namespace psd::testing {

template <typename F>
bool Eventually(F cond) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace psd::testing

#endif  // PSD_TESTS_SUPPORT_EVENTUALLY_H_
