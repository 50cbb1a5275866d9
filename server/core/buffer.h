// Buffer: a word-aligned, zero-padded byte buffer for tensor values, accumulators and slots.
// Word alignment and zeroed padding let pull replies reference the bytes in place
// (capnp referenceExternalData). Not thread-safe; owners say who guards it.
#ifndef PSD_SERVER_CORE_BUFFER_H_
#define PSD_SERVER_CORE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace psd::server {

class Buffer {
 public:
  explicit Buffer(size_t bytes) : words_(std::make_unique<uint64_t[]>((bytes + 7) / 8)), bytes_(bytes) {}
  // The bytes are left unset: the caller overwrites all of them (a checkpoint read); the padding
  // after them is zero. Saves a pass that zeroes memory about to be filled.
  struct Uninitialized {};
  Buffer(size_t bytes, Uninitialized)
      : words_(std::make_unique_for_overwrite<uint64_t[]>((bytes + 7) / 8)), bytes_(bytes) {
    if (bytes % 8 != 0) words_[bytes / 8] = 0;
  }
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
  std::unique_ptr<uint64_t[]> words_;  // value-initialized: padding bytes are zero
  size_t bytes_;
};

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_BUFFER_H_
