// Buffer: a word-aligned, zero-padded byte buffer for tensor values, accumulators and slots.
// Word alignment and zeroed padding let pull replies reference the bytes in place
// (capnp referenceExternalData). Not thread-safe; owners say who guards it.
//
// A big buffer's storage (kRecycledBufferBytes and up) is kept when the buffer goes and given to
// the next buffer of the same size (buffer.cc): glibc maps every block over 32 MiB afresh and
// unmaps it when freed, so a big table copied on write each step (its older value let go by the
// replica copy that held it) came as zeroed pages, a page fault per 4 KiB.
#ifndef PSD_SERVER_CORE_BUFFER_H_
#define PSD_SERVER_CORE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace psd::server {

class Buffer {
 public:
  // Zeroed.
  explicit Buffer(size_t bytes);
  // The bytes are left unset: the caller overwrites all of them (a checkpoint read); the padding
  // after them is zero. Saves a pass that zeroes memory about to be filled.
  struct Uninitialized {};
  Buffer(size_t bytes, Uninitialized);
  // A deep copy (copy-on-write of a value a reader still holds).
  Buffer(const Buffer& other) : Buffer(other.bytes_, Uninitialized{}) {
    std::memcpy(data(), other.data(), (bytes_ + 7) / 8 * 8);  // the padding too (zero there)
  }
  Buffer(Buffer&&) = default;
  Buffer& operator=(const Buffer&) = delete;
  Buffer& operator=(Buffer&&) = default;
  void* data() { return words_.get(); }
  const void* data() const { return words_.get(); }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(words_.get());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(words_.get());
  }

 private:
  // Frees the storage, or keeps it for the next buffer of its size.
  struct Release {
    size_t words = 0;
    void operator()(uint64_t* p) const;
  };
  std::unique_ptr<uint64_t[], Release> words_;
  size_t bytes_;
};

// Buffers of this size and up have their storage kept for reuse.
inline constexpr size_t kRecycledBufferBytes = size_t{32} << 20;
// The kept storage may total this much; the storage let go last is kept even when it alone is more
// (the next step of the job that let it go asks for it again).
inline constexpr size_t kRecycledBufferBudget = size_t{256} << 20;

struct RecycledBuffers {
  uint64_t held_bytes = 0;  // storage kept now, not in any buffer
  uint64_t reused = 0;      // buffers given kept storage (since the process started)
};
RecycledBuffers RecycledBufferStats();
// Frees the storage kept now (a test; a daemon shrinking after a job).
void ReleaseRecycledBuffers();

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_BUFFER_H_
