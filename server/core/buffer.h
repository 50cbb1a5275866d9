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

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

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
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(const Buffer&) = delete;
  Buffer& operator=(Buffer&& other) noexcept;
  // Writable bytes. Taking them ends the list of changes (below): whoever writes through this
  // pointer does not say where.
  void* data() {
    Unlisted();
    Written();
    return words_.get();
  }
  const void* data() const { return words_.get(); }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(words_.get());
  }

  // What changed since this buffer was copied from another. The engine copies a value on write (a
  // replica's copy shares the old one) and then updates some rows or a chunk of it, and says which;
  // replication then compares only those bytes with the copy before instead of the whole table
  // (checkpoint/snapshot_delta.h). The owner's guard covers these like the bytes.
  //
  // A number no other buffer of this process has (a copy gets its own).
  uint64_t id() const { return id_; }
  // Its bytes are now `from`'s: the changes are listed from here on.
  void MarkCopiedFrom(const Buffer& from);
  // This buffer was just made as a copy of `live`, which lists its changes since some buffer X:
  // this one now lists the same (its bytes differ from X's there only). For a buffer updated in
  // place that is copied whole at each snapshot (an optimizer's slots), followed by
  // live.MarkCopiedFrom(*this). Allocates nothing that may fail to the caller: without memory for
  // the list, this buffer lists nothing (its changes are not known, so it is compared whole).
  void TakeChangesOf(const Buffer& live) noexcept;
  // Writable bytes for a writer that says with MarkChanged what it writes (before writing it).
  void* listed_data() {
    Written();
    return words_.get();
  }
  // Bumped whenever the bytes may have been written (data(), listed_data(), CatchUp, a move): the
  // engine reuses a retired value's buffer as the next sum and updates rows or a chunk in place, so
  // something derived from a buffer's bytes (a conversion to another dtype) is valid while the
  // buffer is the same one AND its generation is the one it was derived at. A buffer is written only
  // while nobody else holds it, so a reader that holds it reads a generation that stays.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // Bytes [offset, offset + length) are about to be written. Once the list would grow past what
  // pays (more runs than one per 2 KiB, or half the bytes), or there is no memory for a longer
  // one, it ends.
  void MarkChanged(uint64_t offset, uint64_t length) noexcept;
  // The id of the buffer this one was copied from while every byte written since lies in
  // changes(); 0 when that is not known.
  uint64_t copied_from() const { return copied_from_.load(std::memory_order_relaxed); }
  // (offset, length) runs, in the order written (they may overlap). Meaningful while copied_from().
  const std::vector<std::pair<uint64_t, uint64_t>>& changes() const { return changes_; }
  // Makes this buffer a copy of `from` (of the same size), as Buffer(from) then MarkCopiedFrom(from)
  // would, in storage that holds an older value: the engine's copy on write into a table it retired.
  // When `from` descends from this buffer's bytes through copies that listed every write since —
  // `chain` (newest first, maybe empty), then this one: from.copied_from() == chain[0]->id(), ...,
  // chain.back()->copied_from() == id() — only the bytes their lists name are copied; otherwise all
  // of them. So nothing may have written this buffer since the first of those copies was taken
  // from it. It gets a new id (its bytes are another value now). Returns whether only the listed
  // bytes were copied. Allocates nothing (a commit's snapshot calls it once it may not fail).
  bool CatchUp(const Buffer& from, std::initializer_list<const Buffer*> chain) noexcept;

 private:
  // Frees the storage, or keeps it for the next buffer of its size.
  struct Release {
    size_t words = 0;
    void operator()(uint64_t* p) const;
  };
  // Ends the list. (Atomic: readers of a value may take data() on several threads at once; only a
  // listed buffer has anything to clear.)
  void Unlisted() {
    if (copied_from_.load(std::memory_order_relaxed) != 0) copied_from_.store(0, std::memory_order_relaxed);
  }
  void Written() { generation_.fetch_add(1, std::memory_order_acq_rel); }
  std::unique_ptr<uint64_t[], Release> words_;
  size_t bytes_;
  uint64_t id_;
  std::atomic<uint64_t> copied_from_{0};
  std::atomic<uint64_t> generation_{0};
  uint64_t changed_bytes_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> changes_;
};

// Buffers of this size and up have their storage kept for reuse.
inline constexpr size_t kRecycledBufferBytes = size_t{32} << 20;
// The kept storage may total this much; the storage let go last is kept even when it alone is more
// (the next step of the job that let it go asks for it again).
inline constexpr size_t kRecycledBufferBudget = size_t{256} << 20;

// Where big buffers' storage comes from instead of the heap: the daemon's values segment
// (service/values_segment.h), which same-host workers map read-only to copy pulled values straight
// from the buffer psd published. Implementations are thread-safe.
class BufferStorage {
 public:
  virtual ~BufferStorage() = default;
  // Storage for `bytes` (a multiple of 8; its bytes unset), or null: then the heap's.
  virtual void* Allocate(size_t bytes) = 0;
  // Gives `p` back when it is storage of this one (true); false: not its own.
  virtual bool Free(void* p, size_t bytes) = 0;
};
// Buffers of this size and up take their storage from the BufferStorage set, where one is.
inline constexpr size_t kSharedStorageMinBytes = size_t{256} << 10;
// From now on, for this process (once: a later call is ignored, as buffers may hold the first
// one's storage). `storage` lives as long as the process.
void SetBufferStorage(BufferStorage* storage);

struct RecycledBuffers {
  uint64_t held_bytes = 0;  // storage kept now, not in any buffer
  uint64_t reused = 0;      // buffers given kept storage (since the process started)
};
RecycledBuffers RecycledBufferStats();
// Frees the storage kept now (a test; a daemon shrinking after a job).
void ReleaseRecycledBuffers();

}  // namespace psd::server

#endif  // PSD_SERVER_CORE_BUFFER_H_
