// ConvertedValues: published values delivered in another dtype (a float32 variable pulled as
// bfloat16, a half variable's float32 master delivered as its half), converted once per published
// value and dtype however many workers pull it. Published buffers are immutable, so a conversion
// is valid as long as its source is the variable's value; it is kept per (variable, dtype) and
// replaced when a newer value is asked for, so the memory it holds is at most one converted copy
// per variable and dtype that readers ask for.
//
// Thread-safety: Get may be called from any thread; `mu_` guards the map, each entry's own mutex
// its conversion (different values convert in parallel, one value converts once).
#ifndef PSD_SERVER_CORE_CONVERTED_VALUES_H_
#define PSD_SERVER_CORE_CONVERTED_VALUES_H_

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "base/mutex.h"
#include "core/buffer.h"
#include "psd/tensor.h"

namespace psd::server {

class ConvertedValues {
 public:
  // `source`, the value of `variable` (elements of `from`), as `to`: the same buffer for every
  // caller while it is the newest value of `variable` asked for in `to`.
  std::shared_ptr<const Buffer> Get(std::string_view variable, const std::shared_ptr<const Buffer>& source, DType from,
                                    DType to) EXCLUDES(mu_);

 private:
  struct Entry {
    Mutex mu;
    std::weak_ptr<const Buffer> source GUARDED_BY(mu);
    std::shared_ptr<const Buffer> converted GUARDED_BY(mu);  // `source` as the entry's dtype
  };
  Mutex mu_;
  std::map<std::pair<std::string, DType>, std::shared_ptr<Entry>, std::less<>> entries_ GUARDED_BY(mu_);
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_CONVERTED_VALUES_H_
