// The records of a checkpoint part or a replica's copy: one format for both (checkpoint.h's v4
// layout after the magic; v1-v3 parts hold the same records with their tensors inline). The
// writer lists the tensors it names for the caller to move as the payload; the reader checks every
// field against what it was given, so a corrupt file or copy is an error, never a crash.
//
// Internal to the checkpoint layer (checkpoint.cc writes and reads files, serialized_copy.cc the
// copies in memory). Thread-safety: none needed; each object is used by one thread.
#ifndef PSD_SERVER_CHECKPOINT_PART_RECORDS_H_
#define PSD_SERVER_CHECKPOINT_PART_RECORDS_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/snapshot.h"
#include "psd/status.h"

namespace psd::server {

// Serializes a part's records (v3 layout; tensors as their byte counts) and lists the payload.
class RecordWriter {
 public:
  void Bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  template <typename T>
  void Pod(T v) {
    Bytes(&v, sizeof(v));
  }
  void Str(const std::string& s) {
    Pod<uint32_t>(static_cast<uint32_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  void Blob(const Buffer* b) {
    Pod<uint64_t>(b ? b->bytes() : 0);
    if (b && b->bytes() > 0) {
      payload_.push_back(b);
      payload_bytes_ += b->bytes();
    }
  }
  const std::string& records() const { return out_; }
  const std::vector<const Buffer*>& payload() const { return payload_; }
  uint64_t payload_bytes() const { return payload_bytes_; }

 private:
  std::string out_;
  std::vector<const Buffer*> payload_;
  uint64_t payload_bytes_ = 0;
};

// Reads a part's records, bounds-checking every read (a corrupt file is an error, not a crash).
// v1-v3 parts hold their tensors inline; v4 records only their sizes, and Blob() allocates the
// tensor and lists it in payload() for the caller to fill from the file.
class RecordReader {
 public:
  RecordReader(const uint8_t* data, size_t size, bool inline_blobs, uint64_t payload_limit = 0)
      : data_(data), size_(size), inline_(inline_blobs), payload_left_(payload_limit) {}
  bool Bytes(void* out, size_t n) {
    if (n > size_ - pos_) return false;
    std::memcpy(out, data_ + pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Pod(T* v) {
    return Bytes(v, sizeof(T));
  }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!Pod(&n) || n > size_ - pos_) return false;
    s->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return true;
  }
  bool Blob(std::shared_ptr<const Buffer>* out) {
    uint64_t n = 0;
    if (!Pod(&n)) return false;
    if (inline_) {
      if (n > size_ - pos_) return false;
      auto b = std::make_shared<Buffer>(n, Buffer::Uninitialized{});
      std::memcpy(b->data(), data_ + pos_, n);
      pos_ += n;
      *out = std::move(b);
      return true;
    }
    if (n > payload_left_) return false;  // more than the file holds
    payload_left_ -= n;
    auto b = std::make_shared<Buffer>(n, Buffer::Uninitialized{});
    if (n > 0) payload_.push_back(b);
    *out = std::move(b);
    return true;
  }
  size_t pos() const { return pos_; }
  uint64_t payload_left() const { return payload_left_; }
  const std::vector<std::shared_ptr<Buffer>>& payload() const { return payload_; }

 private:
  const uint8_t* data_;
  size_t size_;
  bool inline_;
  uint64_t payload_left_;
  size_t pos_ = 0;
  std::vector<std::shared_ptr<Buffer>> payload_;
};

// INVALID_ARGUMENT "checkpoint part is malformed: <why>".
Status BadPart(const std::string& why);

// The records of a part, after its magic (`version` 1-4 says which fields there are).
Status ParseRecords(RecordReader& r, int version, ShardSnapshot* out);

// The records of a part (v4: tensors as their sizes; the payload is listed in `w`).
void WriteRecords(const ShardSnapshot& snap, RecordWriter* out);

}  // namespace psd::server

#endif  // PSD_SERVER_CHECKPOINT_PART_RECORDS_H_
