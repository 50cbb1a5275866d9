#include "core/converted_values.h"

#include "psd/half.h"

namespace psd::server {

std::shared_ptr<const Buffer> ConvertedValues::Get(std::string_view variable,
                                                   const std::shared_ptr<const Buffer>& source, DType from, DType to) {
  std::shared_ptr<Entry> entry;
  {
    MutexLock lock(&mu_);
    auto& slot = entries_[{std::string(variable), to}];
    if (!slot) slot = std::make_shared<Entry>();
    entry = slot;
  }
  MutexLock lock(&entry->mu);
  // The same value: the same buffer (its owner is compared, not merely an address), not written
  // since. The caller holds `source`, so nothing writes it while this reads.
  const uint64_t generation = source->generation();
  bool same = entry->converted && !entry->source.owner_before(source) && !source.owner_before(entry->source) &&
              !entry->source.expired() && entry->generation == generation;
  if (!same) {
    size_t n = source->bytes() / DTypeSize(from);
    auto out = std::make_shared<Buffer>(n * DTypeSize(to), Buffer::Uninitialized{});
    ConvertElements(source->data(), from, out->data(), to, n);
    entry->source = source;
    entry->generation = generation;
    entry->converted = std::move(out);
  }
  return entry->converted;
}

}  // namespace psd::server
