// Buffer's storage, and the big blocks kept for reuse (buffer.h).
#include "core/buffer.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <new>
#include <utility>

#include "base/mutex.h"
#include "base/thread_annotations.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
// A kept block is poisoned: a use of a buffer after it went still fails under AddressSanitizer.
#define PSD_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define PSD_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define PSD_POISON(p, n) ((void)(p), (void)(n))
#define PSD_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace psd::server {

namespace {

constexpr size_t kRecycledWords = kRecycledBufferBytes / 8;

std::atomic<BufferStorage*> the_storage{nullptr};

// Storage for `words` words, unset: the BufferStorage's for big buffers, where one is set.
uint64_t* NewStorage(size_t words) {
  if (words * 8 >= kSharedStorageMinBytes) {
    if (BufferStorage* s = the_storage.load(std::memory_order_acquire)) {
      if (void* p = s->Allocate(words * 8)) return static_cast<uint64_t*>(p);
    }
  }
  return new uint64_t[words];
}

void DeleteStorage(uint64_t* p, size_t words) {
  if (words * 8 >= kSharedStorageMinBytes) {
    if (BufferStorage* s = the_storage.load(std::memory_order_acquire); s != nullptr && s->Free(p, words * 8)) return;
  }
  delete[] p;
}

class Recycler {
 public:
  // Kept storage of exactly `words`, or null.
  uint64_t* Take(size_t words) {
    MutexLock lock(&mu_);
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->second != words) continue;
      uint64_t* p = it->first;
      kept_.erase(std::next(it).base());
      held_ -= words * 8;
      ++reused_;
      PSD_UNPOISON(p, words * 8);
      return p;
    }
    return nullptr;
  }

  void Keep(uint64_t* p, size_t words) {
    std::deque<std::pair<uint64_t*, size_t>> drop;
    {
      MutexLock lock(&mu_);
      PSD_POISON(p, words * 8);
      kept_.emplace_back(p, words);
      held_ += words * 8;
      // The oldest go first; the newest stays even when it alone is over the budget.
      while (held_ > kRecycledBufferBudget && kept_.size() > 1) {
        held_ -= kept_.front().second * 8;
        drop.push_back(kept_.front());
        kept_.pop_front();
      }
    }
    Free(drop);
  }

  void ReleaseAll() {
    std::deque<std::pair<uint64_t*, size_t>> drop;
    {
      MutexLock lock(&mu_);
      drop.swap(kept_);
      held_ = 0;
    }
    Free(drop);
  }

  RecycledBuffers Stats() {
    MutexLock lock(&mu_);
    return {held_, reused_};
  }

 private:
  static void Free(const std::deque<std::pair<uint64_t*, size_t>>& blocks) {
    for (const auto& [p, words] : blocks) {
      PSD_UNPOISON(p, words * 8);
      DeleteStorage(p, words);
    }
  }

  Mutex mu_;
  std::deque<std::pair<uint64_t*, size_t>> kept_ GUARDED_BY(mu_);  // oldest first
  uint64_t held_ GUARDED_BY(mu_) = 0;
  uint64_t reused_ GUARDED_BY(mu_) = 0;
};

// Never destroyed: a buffer may go after static destructors ran.
Recycler& TheRecycler() {
  static Recycler* r = new Recycler;
  return *r;
}

uint64_t NextId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// Storage for `words` words, unset.
uint64_t* Allocate(size_t words) {
  if (words >= kRecycledWords) {
    if (uint64_t* p = TheRecycler().Take(words)) return p;
  }
  return NewStorage(words);
}

}  // namespace

void Buffer::Release::operator()(uint64_t* p) const {
  if (p == nullptr) return;
  if (words >= kRecycledWords) return TheRecycler().Keep(p, words);
  DeleteStorage(p, words);
}

void SetBufferStorage(BufferStorage* storage) {
  BufferStorage* none = nullptr;
  the_storage.compare_exchange_strong(none, storage, std::memory_order_acq_rel);
}

Buffer::Buffer(size_t bytes, Uninitialized)
    : words_(Allocate((bytes + 7) / 8), Release{(bytes + 7) / 8}), bytes_(bytes), id_(NextId()) {
  if (bytes % 8 != 0) words_[bytes / 8] = 0;
}

Buffer::Buffer(size_t bytes) : Buffer(bytes, Uninitialized{}) { std::memset(words_.get(), 0, (bytes + 7) / 8 * 8); }

Buffer::Buffer(Buffer&& other) noexcept
    : words_(std::move(other.words_)),
      bytes_(other.bytes_),
      id_(other.id_),
      copied_from_(other.copied_from()),
      changed_bytes_(other.changed_bytes_),
      changes_(std::move(other.changes_)) {
  other.Unlisted();
  other.Written();
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  words_ = std::move(other.words_);
  bytes_ = other.bytes_;
  id_ = other.id_;
  copied_from_.store(other.copied_from(), std::memory_order_relaxed);
  changed_bytes_ = other.changed_bytes_;
  changes_ = std::move(other.changes_);
  other.Unlisted();
  Written();
  other.Written();
  return *this;
}

void Buffer::MarkCopiedFrom(const Buffer& from) {
  copied_from_.store(from.id_, std::memory_order_relaxed);
  changed_bytes_ = 0;
  changes_.clear();
}

bool Buffer::CatchUp(const Buffer& from, std::initializer_list<const Buffer*> chain) noexcept {
  // from, then the chain: each copied from the next (the last one from this buffer) and listed
  // every write since.
  const Buffer* const* const links = chain.begin();
  const size_t n = chain.size() + 1;
  auto copy_at = [&](size_t i) { return i == 0 ? &from : links[i - 1]; };
  bool listed = from.bytes_ == bytes_;
  for (size_t i = 0; listed && i < n; ++i) {
    const uint64_t older = i + 1 < n ? copy_at(i + 1)->id_ : id_;
    listed = copy_at(i)->copied_from() != 0 && copy_at(i)->copied_from() == older;
  }
  auto* to = reinterpret_cast<char*>(words_.get());
  const auto* src = static_cast<const char*>(from.data());
  if (listed) {
    for (size_t i = 0; i < n; ++i) {
      for (const auto& [offset, length] : copy_at(i)->changes_) {
        if (offset < bytes_) std::memcpy(to + offset, src + offset, std::min<uint64_t>(length, bytes_ - offset));
      }
    }
  } else {
    std::memcpy(to, src, (std::min(bytes_, from.bytes_) + 7) / 8 * 8);  // the padding too (zero there)
  }
  id_ = NextId();
  Written();
  MarkCopiedFrom(from);
  return listed;
}

void Buffer::TakeChangesOf(const Buffer& live) noexcept {
  try {
    changes_ = live.changes_;
  } catch (const std::bad_alloc&) {
    copied_from_.store(0, std::memory_order_relaxed);  // not known: compared whole
    changed_bytes_ = 0;
    changes_.clear();
    return;
  }
  copied_from_.store(live.copied_from(), std::memory_order_relaxed);
  changed_bytes_ = live.changed_bytes_;
}

void Buffer::MarkChanged(uint64_t offset, uint64_t length) noexcept {
  if (copied_from() == 0 || length == 0) return;
  bool full = false;
  if (!changes_.empty() && offset >= changes_.back().first &&
      offset <= changes_.back().first + changes_.back().second) {
    auto& last = changes_.back();  // runs on from the last one (rows written in order)
    const uint64_t end = std::max(last.first + last.second, offset + length);
    changed_bytes_ += end - (last.first + last.second);
    last.second = end - last.first;
  } else {
    try {
      changes_.emplace_back(offset, length);
      changed_bytes_ += length;
    } catch (const std::bad_alloc&) {
      full = true;
    }
  }
  if (full || changes_.size() > std::max<size_t>(64, bytes_ / 2048) || changed_bytes_ * 2 > bytes_) {
    copied_from_.store(0, std::memory_order_relaxed);  // too much to list (or no memory for it): not known
    changed_bytes_ = 0;
    std::vector<std::pair<uint64_t, uint64_t>>().swap(changes_);
  }
}

RecycledBuffers RecycledBufferStats() { return TheRecycler().Stats(); }

void ReleaseRecycledBuffers() { TheRecycler().ReleaseAll(); }

}  // namespace psd::server
