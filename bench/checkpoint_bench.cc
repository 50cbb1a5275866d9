// psd_bench --checkpoint-bytes: a checkpoint written and restored, against the disk.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "checkpoint/checkpoint.h"
#include "config/server_config.h"
#include "core/optimizer.h"
#include "core/training_engine.h"

namespace psd_bench {

// --checkpoint-bytes: builds a sync engine holding that many bytes of float32 variables (split
// over --variables; --optimizer adds its slots), snapshots it as psd's checkpoint thread gets it,
// writes the checkpoint to a fresh directory under --checkpoint-dir and restores it: the file
// part (LoadLatestCheckpoint: read + verify + parse into tensors) and the engine's adoption of it
// (TrainingEngine::Restore) are timed apart. The restored values are compared with the originals.
// --drop-caches asks the kernel to drop the page cache before the restore (needs root; the report
// says "cold" or "warm").
int RunCheckpointBench(const Options& opt, uint64_t model_bytes) {
  namespace srv = psd::server;
  auto vars = MakeVariables(model_bytes, opt.variables);
  if (!vars.ok()) {
    std::fprintf(stderr, "psd_bench: %s\n", vars.status().message().c_str());
    return 1;
  }
  srv::ServerConfig config;
  config.optimizer.name = opt.optimizer;
  config.optimizer.learning_rate = opt.learning_rate;
  size_t largest = 0;
  for (const VarSpec& v : *vars) largest = std::max(largest, v.bytes());
  config.max_frame_bytes = std::max<uint64_t>(config.max_frame_bytes, largest + kFrameOverheadBytes);
  auto make_engine = [&]() -> std::unique_ptr<srv::TrainingEngine> {
    auto o = srv::MakeOptimizer(config.optimizer);
    if (!o.ok()) {
      std::fprintf(stderr, "psd_bench: --optimizer: %s\n", o.status().message().c_str());
      return nullptr;
    }
    return std::make_unique<srv::TrainingEngine>(config, std::move(*o));
  };
  auto engine = make_engine();
  if (!engine) return 1;
  // Non-zero values (a varied pattern, so nothing downstream can shortcut zeros).
  auto value_at = [](size_t i) { return static_cast<float>(i % 9973) * 0.001f - 3.0f; };
  {
    std::vector<float> pattern(largest / sizeof(float));
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = value_at(i);
    for (const VarSpec& v : *vars) {
      srv::VariableDef def;
      def.name = v.name;
      def.shape = {v.elements};
      def.initial = pattern.data();
      def.initial_bytes = v.bytes();
      auto made = engine->CreateVariable(def);
      if (!made.ok()) {
        std::fprintf(stderr, "psd_bench: %s\n", made.status().message().c_str());
        return 1;
      }
    }
  }
  auto snap = engine->SnapshotIfAtBoundary();
  if (!snap) {
    std::fprintf(stderr, "psd_bench: the engine gave no snapshot\n");
    return 1;
  }
  uint64_t state_bytes = 0;
  size_t slots = 0;
  for (const auto& v : snap->variables) {
    state_bytes += v.value->bytes();
    for (const auto& s : v.slots) state_bytes += s.second->bytes();
    slots = v.slots.size();
  }
  std::string dir = opt.checkpoint_dir + "/psd_bench_ckpt." + std::to_string(getpid());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (!std::filesystem::create_directories(dir, ec)) {
    std::fprintf(stderr, "psd_bench: cannot create %s: %s\n", dir.c_str(), ec.message().c_str());
    return 1;
  }
  auto cleanup = [&] {
    if (!opt.keep_checkpoint) std::filesystem::remove_all(dir, ec);
  };

  auto t0 = Clock::now();
  auto info = srv::WriteCheckpoint(dir, *snap, 0, 1, 1);
  const double write_ms = Ms(Clock::now() - t0);
  if (!info.ok()) {
    std::fprintf(stderr, "psd_bench: checkpoint write: %s\n", info.status().ToString().c_str());
    cleanup();
    return 1;
  }
  if (opt.restore_after_s > 0) {
    sync();
    std::this_thread::sleep_for(std::chrono::duration<double>(opt.restore_after_s));
  }
  // As at a daemon's start, the restore runs with no other model in memory: the written state goes.
  const size_t nvars = snap->variables.size();
  snap.reset();
  engine.reset();
  std::string cache = "warm";
  if (opt.drop_caches) {
    sync();
    std::ofstream drop("/proc/sys/vm/drop_caches");
    drop << "3\n";
    drop.flush();
    cache = drop ? "cold" : "warm (dropping the page cache was refused)";
  }
  auto fresh = make_engine();
  if (!fresh) return 1;
  srv::ShardSnapshot back;
  t0 = Clock::now();
  auto loaded = srv::LoadLatestCheckpoint(dir, 0, &back);
  const double load_ms = Ms(Clock::now() - t0);
  if (!loaded.ok()) {
    std::fprintf(stderr, "psd_bench: checkpoint restore: %s\n", loaded.status().ToString().c_str());
    cleanup();
    return 1;
  }
  t0 = Clock::now();
  Status restored = fresh->Restore(back);
  const double engine_ms = Ms(Clock::now() - t0);
  cleanup();
  if (!restored.ok()) {
    std::fprintf(stderr, "psd_bench: engine restore: %s\n", restored.ToString().c_str());
    return 1;
  }
  // Bit-identical: every restored value is the pattern it was created with.
  bool same = back.variables.size() == nvars;
  for (size_t i = 0; same && i < back.variables.size(); ++i) {
    const srv::VariableSnapshot& v = back.variables[i];
    auto spec = std::find_if(vars->begin(), vars->end(), [&](const VarSpec& s) { return s.name == v.name; });
    same = spec != vars->end() && v.value->bytes() == spec->bytes();
    const float* f = v.value->as<float>();
    for (size_t k = 0; same && k < spec->bytes() / sizeof(float); ++k) {
      const float want = value_at(k);
      same = std::memcmp(&f[k], &want, sizeof(float)) == 0;
    }
  }
  if (!same) {
    std::fprintf(stderr, "psd_bench: the restored values differ from the written ones\n");
    return 1;
  }
  const double part = static_cast<double>(info->part_bytes);
  const double write_mbs = part / 1e6 / (write_ms / 1e3), load_mbs = part / 1e6 / (load_ms / 1e3);
  if (opt.json) {
    std::printf("{\"checkpoint_state_bytes\": %" PRIu64 ", \"part_bytes\": %" PRIu64
                ", \"variables\": %d, \"slots_per_variable\": %zu, "
                "\"write_ms\": %.1f, \"write_mb_s\": %.1f, \"restore_ms\": %.1f, \"restore_mb_s\": %.1f, "
                "\"engine_restore_ms\": %.1f, \"cache\": \"%s\", \"dir\": %s}\n",
                state_bytes, info->part_bytes, opt.variables, slots, write_ms, write_mbs, load_ms, load_mbs, engine_ms,
                cache.c_str(), JsonString(opt.checkpoint_dir).c_str());
  } else {
    std::printf("checkpoint  %" PRIu64 " bytes of state: %d float32 variable(s), optimizer %s (%zu slot(s) each)\n",
                state_bytes, opt.variables, opt.optimizer.c_str(), slots);
    std::printf("            part %" PRIu64 " bytes, in %s\n", info->part_bytes, opt.checkpoint_dir.c_str());
    std::printf("write       %9.1f ms  %8.1f MB/s  (XXH3 + parallel pwrite + fsync + rename + manifest)\n", write_ms,
                write_mbs);
    std::printf("restore     %9.1f ms  %8.1f MB/s  (read + verify + parse into tensors; page cache %s)\n", load_ms,
                load_mbs, cache.c_str());
    std::printf("engine      %9.1f ms               (TrainingEngine::Restore adopting the restored tensors)\n",
                engine_ms);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace psd_bench
