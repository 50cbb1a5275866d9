// psd_bench's shared pieces: its options, the endpoint and model it runs against, size parsing,
// percentiles and JSON, and the entry points of its non-training benches.
#ifndef PSD_BENCH_BENCH_UTIL_H_
#define PSD_BENCH_BENCH_UTIL_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "psclient/client.h"
#include "psd/status.h"

namespace psd_bench {

using Clock = std::chrono::steady_clock;
using psd::Result;
using psd::Status;

// capnp lists hold at most 2^29 - 1 elements, so one variable's Data blob must stay below that.
constexpr uint64_t kMaxVariableBytes = (1ull << 29) - 8;
// Room for the message structure around the tensor bytes (names, shapes, segment table).
constexpr uint64_t kFrameOverheadBytes = 64 << 10;
constexpr uint64_t kFrameOverheadPerVariable = 1 << 10;
constexpr char kEmbeddingName[] = "bench/emb";

struct Options {
  std::string connect;           // HOST:PORT, or a cluster's HOST:PORT,...; empty: start psd in this process
  std::string tls_dir;           // TLS (deploy/make_tls_certs.sh DIR): psd serves it, workers verify it
  int shards = 1;                // in-process: a cluster of this many psd shards
  int replicas_per_shard = 1;    // in-process cluster: psd's --replicas-per-shard
  std::string slice_bytes_text;  // in-process cluster: --slice-bytes (empty: each variable over every shard)
  int workers = 2;
  int replicas_to_aggregate = -1;  // -1: the number of workers
  int backup_replicas = -1;        // -1: not given (psd's default, 0)
  std::string mode = "sync";       // in-process psd: sync, async, ssp
  int64_t staleness = -1;          // in-process psd, ssp: -1: psd's default
  std::string optimizer = "sgd";   // in-process psd
  std::string model_bytes_text = "4M";
  std::string push_frame_bytes_text = "1M";  // ClientOptions::push_frame_bytes (0: one frame per push)
  uint64_t push_frame_bytes = 1ull << 20;
  std::string pull_frame_bytes_text = "16M";  // ClientOptions::pull_frame_bytes
  uint64_t pull_frame_bytes = 16ull << 20;
  int64_t busy_poll_us = 0;               // ClientOptions::busy_poll_us
  int64_t compute_us = 0;                 // --compute-us: each step's idle wait between pull and push
  std::string shared_memory_text = "1G";  // ClientOptions::shared_memory_bytes
  uint64_t shared_memory_bytes = 1ull << 30;
  int shm_lane = 1;                   // ClientOptions::shm_lane
  std::string shm_piece_text = "4M";  // ClientOptions::shm_piece_bytes
  uint64_t shm_piece_bytes = 4ull << 20;
  int copy_threads = 2;         // ClientOptions::copy_threads
  bool shared_buffers = false;  // gradients and values (sparse: rows) in Client::AllocateShared memory
  psd::DType grad_dtype = psd::DType::kFloat32;
  uint64_t model_bytes = 0;
  int variables = 1;
  bool sparse = false;
  bool engine_only = false;  // --sparse: the daemon's engine alone (RunSparseEngineBench)
  int64_t embedding_rows = 1000000;
  int64_t embedding_dim = 64;
  int64_t batch_rows = 4096;
  uint64_t seed = 1;
  double zipf = 0;  // --sparse: rows drawn Zipf(s) by frequency rank (0: uniform)
  int warmup = 3;
  int steps = 20;
  bool fused = false;
  bool pull_in_push = false;
  int io_threads = 0;  // 0: one per core, as psd's --threads
  double learning_rate = 0.01;
  int64_t token_timeout_ms = 30000;
  double retry_s = 0;  // > 0: a step that fails as psd re-forms (UNAVAILABLE, ...) is retried this long
  double timeout_s = 300;
  bool json = false;
  bool finish = false;
  std::string log_level = "warn";
  int collectives = 0;  // > 0: the reduce_to / batch_reduce_to comparison instead of training
  int64_t collective_elements = 16;
  std::string checkpoint_bytes_text;  // non-empty: the checkpoint write/restore bench instead of training
  std::string checkpoint_dir = "/tmp";
  bool drop_caches = false;
  bool keep_checkpoint = false;
  double restore_after_s = 0;
};

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::vector<std::string> cluster;  // a cluster's shards (host and port unused then)
};

struct VarSpec {
  std::string name;
  int64_t elements = 0;
  size_t bytes() const { return static_cast<size_t>(elements) * sizeof(float); }
};

// CPU seconds (user + system) this process has used so far: the workers' cost, and the daemon's
// too when it runs in-process (busy-poll's price shows here).
double ProcessCpuSeconds();
// "4096", "4K", "64M", "1G" (powers of 1024).
Result<uint64_t> ParseBytes(const std::string& text);
// --connect HOST:PORT.
Result<Endpoint> ParseEndpoint(const std::string& text);
// Splits the model into float32 variables whose sizes differ by at most one element.
Result<std::vector<VarSpec>> MakeVariables(uint64_t model_bytes, int count);
// How --sparse draws its rows, for the report: "uniform" or "Zipf 1.1".
inline std::string RowsDrawn(double zipf) {
  if (zipf <= 0) return "uniform";
  char text[32];
  std::snprintf(text, sizeof(text), "Zipf %g", zipf);
  return text;
}

inline double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
// Nearest-rank percentile of `v` (sorted in place); 0 for no samples.
double Percentile(std::vector<double>& v, double p);
// A JSON string literal of `s`; a number, or null for NaN and infinity.
std::string JsonString(const std::string& s);
std::string JsonNumber(double v);
// --tls-dir: the workers speak TLS and verify psd against DIR/ca.pem.
void ApplyTls(const Options& opt, psclient::ClientOptions& co);

// The benches other than training (psd_bench.cc runs them for their flags).
// --collectives N: batch_reduce_to against N reduce_to calls (collectives_bench.cc).
int RunCollectives(const Options& opt, const Endpoint& ep, int n, int64_t elements);
// --checkpoint-bytes SIZE: a checkpoint's write and restore (checkpoint_bench.cc).
int RunCheckpointBench(const Options& opt, uint64_t model_bytes);
// --sparse --engine-only: sparse steps in the training engine alone (sparse_engine_bench.cc).
int RunSparseEngineBench(const Options& opt);
// --sparse --engine-only --mode async: async sparse pushes in the engine alone, another variable's
// pulls and pushes timed meanwhile (sparse_engine_bench.cc).
int RunSparseEngineAsyncBench(const Options& opt);

}  // namespace psd_bench

#endif  // PSD_BENCH_BENCH_UTIL_H_
