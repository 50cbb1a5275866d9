// ConvertedValues: published values delivered in another dtype (a float32 variable pulled as
// bfloat16, a half variable's float32 master delivered as its half), converted once per published
// value and dtype however many workers pull it. A conversion is valid while its source is the same
// buffer at the same Buffer::generation(): the engine writes a published buffer in place (sparse
// rows, async chunks) and reuses a retired one as the next sum, so the same buffer is not the same
// value. It is kept per (variable, dtype) and replaced when another value is asked for, so the
// memory it holds is at most one converted copy per variable and dtype that readers ask for.
//
// Thread-safety: Get may be called from any thread; `mu_` guards the map, each entry's own mutex
// its conversion (different values convert in parallel, one value converts once).
#ifndef PSD_SERVER_CORE_CONVERTED_VALUES_H_
#define PSD_SERVER_CORE_CONVERTED_VALUES_H_

#include <cstddef>
#include <cstdint>
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
    uint64_t generation GUARDED_BY(mu) = 0;                  // source's when it was converted
    std::shared_ptr<const Buffer> converted GUARDED_BY(mu);  // `source` as the entry's dtype
  };
  Mutex mu_;
  std::map<std::pair<std::string, DType>, std::shared_ptr<Entry>, std::less<>> entries_ GUARDED_BY(mu_);
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_CONVERTED_VALUES_H_
