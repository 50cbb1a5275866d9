// ScopeExit: runs a callable when the scope ends, by return or by exception. For a promise that
// must hold on every way out (a turn served, a count given back), where a thrown bad_alloc would
// otherwise leave others waiting for it forever.
//
//   ++pending_;
//   ScopeExit give_back([&] { --pending_; });
#ifndef PSD_COMMON_BASE_SCOPE_EXIT_H_
#define PSD_COMMON_BASE_SCOPE_EXIT_H_

#include <utility>

namespace psd {

template <typename F>
class ScopeExit {
 public:
  explicit ScopeExit(F f) : f_(std::move(f)) {}
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;
  ~ScopeExit() {
    if (armed_) f_();
  }
  // The callable will not run.
  void Dismiss() { armed_ = false; }

 private:
  F f_;
  bool armed_ = true;
};

}  // namespace psd

#endif  // PSD_COMMON_BASE_SCOPE_EXIT_H_
