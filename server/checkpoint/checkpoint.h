// Checkpoints: the training state of a cut at a step boundary, written atomically and verified
// before it is ever loaded.
//
// Layout of a checkpoint directory (one per step):
//   <dir>/ckpt-<step, 20 digits>/shard-<k>-of-<P>.psdckpt   one part per shard
//   <dir>/ckpt-<step, 20 digits>/MANIFEST                    written last; names every part
// Each part and the manifest are written to a temporary file, fsynced and renamed; the
// checkpoint directory and its parent are fsynced after. The manifest records each part's size
// and checksum, and carries its own checksum, so a torn or corrupted checkpoint is detected and
// skipped: Load() returns the newest checkpoint whose manifest and parts verify.
//
// Format v4 (written since issue 12; v1-v3 are still read): a part is
//   "PSDCKPT4" | u64 R | records (R bytes: names, shapes, flags, placement; tensors as sizes) |
//   payload (the tensors' bytes, in record order) | u64 checksum
// and its checksum is XXH3-64 (xxhash) over 4 MiB blocks: XXH3-64, seeded with the body's size,
// of the blocks' XXH3-64 hashes. Blocks are written (pwritev at their offsets into one
// preallocated file, writeback started per block, one fsync) and read back (preadv straight into
// the restored tensors) by a few threads, each hashing its block as it moves it: no second pass.
// Its manifest says "psd-checkpoint 2" and "hash xxh3-64" and records the part checksum (the
// trailer); v1-v3 parts sit under a "psd-checkpoint 1" manifest with FNV-1a 64 over whole files.
//
// Thread-safety: free functions; no shared state. Writing and reading are blocking file I/O on the
// caller's thread plus up to 4 short-lived helper threads per part; nothing is locked meanwhile.
#ifndef PSD_SERVER_CHECKPOINT_CHECKPOINT_H_
#define PSD_SERVER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/snapshot.h"
#include "psd/status.h"

namespace psd::server {

struct CheckpointInfo {
  int64_t step = -1;
  std::string path;  // the checkpoint's directory
  // The part written (WriteCheckpoint): what a cluster's manifest records for it.
  std::string part_file;
  uint64_t part_bytes = 0;
  uint64_t part_checksum = 0;  // v4: the part's XXH3 block checksum (its trailer)
};

struct ManifestPart {
  int shard = 0;
  std::string file;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};

// Writes shard `shard` of `shards` and, for a single-shard job, the manifest (a cluster's chief
// writes it with WriteManifest once every part is written). Keeps the newest `keep` checkpoints
// (0: all).
Result<CheckpointInfo> WriteCheckpoint(const std::string& dir, const ShardSnapshot& snapshot, int shard, int shards,
                                       int keep);

// The newest checkpoint in `dir` that verifies, restored into *out (for shard `shard`). NotFound
// if there is none; corrupt ones, and a cluster's (more than one shard: a single daemon restores
// its own), are skipped with a warning naming what failed.
Result<CheckpointInfo> LoadLatestCheckpoint(const std::string& dir, int shard, ShardSnapshot* out);

// Seals checkpoint `step` of a cluster: writes its MANIFEST (atomically; several shards sharing
// one directory may all write the same manifest).
Status WriteManifest(const std::string& dir, int64_t step, int shards, const std::vector<ManifestPart>& parts);

// `text` into `path` so that a power loss leaves the old file or the new one: written to `tmp` and
// synced, renamed over `path`, its directory synced. (A manifest; the cluster's saved term.)
Status WriteFileDurably(const std::string& path, const std::string& tmp, const std::string& text);

// Seals checkpoint `step` on shard `shard` that holds its part but missed the seal (the chief's
// parts come with a formation's restore order): writes the MANIFEST of `parts` only if this
// shard's part in `dir` is there and matches its entry (size and checksum, read whole), so parts
// of two timelines are never sealed together. FailedPrecondition (nothing written) otherwise.
Status SealOwnPart(const std::string& dir, int64_t step, int shard, int shards, const std::vector<ManifestPart>& parts);

// The checkpoints in `dir` that shard `shard` of `shards` can restore: the manifest verifies,
// names `shards` parts, and this shard's part is present with the recorded size and checksum.
// Newest first. `unusable` (if given) gets the other checkpoint directories' steps, newest first:
// present for this shard but not restorable by it (corrupt, or never sealed here). `manifests`
// (if given) gets each restorable step's parts, as its manifest lists them.
std::vector<int64_t> RestorableSteps(const std::string& dir, int shard, int shards,
                                     std::vector<int64_t>* unusable = nullptr,
                                     std::map<int64_t, std::vector<ManifestPart>>* manifests = nullptr);

// Shard `shard`'s part of checkpoint `step` in `dir` as its file says (a version 4 part: its size
// and the checksum its trailer records), read without verifying the part (16 + 8 bytes).
// NotFound if there is no such file; InvalidArgument if it is not a version 4 part.
Result<ManifestPart> PeekOwnPart(const std::string& dir, int64_t step, int shard, int shards);

// Loads shard `shard`'s part of checkpoint `step` (verified first).
Status LoadCheckpointAt(const std::string& dir, int64_t step, int shard, ShardSnapshot* out);

// Checks one checkpoint directory (manifest checksum, part sizes and checksums).
Status VerifyCheckpoint(const std::string& path);

// The checksum of v1-v3 checkpoints (byte at a time: 0.4-0.7 GB/s; v4 uses XXH3).
uint64_t Fnv1a64(const void* data, size_t bytes, uint64_t seed = 1469598103934665603ull);

}  // namespace psd::server

#endif  // PSD_SERVER_CHECKPOINT_CHECKPOINT_H_
