// psd_bench --collectives: batch_reduce_to against reduce_to, one round trip against N.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "psclient/client.h"

namespace psd_bench {

// --collectives N: every worker (a replica) reduces N small tensors (--collective-elements floats
// each) per round, first as one batch_reduce_to, then as N reduce_to calls; each round completes
// when all workers contributed. Prints the mean time per round of each and their ratio.
int RunCollectives(const Options& opt, const Endpoint& ep, int n, int64_t elements) {
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back("bench/metric/" + std::to_string(i));
  std::atomic<int> created{0}, failed{0};
  std::vector<double> batch_ms(static_cast<size_t>(opt.workers)), single_ms(static_cast<size_t>(opt.workers));
  std::vector<uint64_t> batch_requests(static_cast<size_t>(opt.workers)),
      single_requests(static_cast<size_t>(opt.workers));
  std::vector<std::thread> threads;
  for (int w = 0; w < opt.workers; ++w) {
    threads.emplace_back([&, w] {
      psclient::ClientOptions co;
      co.host = ep.host;
      co.port = ep.port;
      co.cluster = ep.cluster;
      co.worker_name = "bench-" + std::to_string(w);
      ApplyTls(opt, co);
      auto c = psclient::Client::Connect(co);
      if (!c.ok()) {
        std::fprintf(stderr, "psd_bench: %s\n", c.status().ToString().c_str());
        ++failed;
        return;
      }
      std::vector<float> value(static_cast<size_t>(elements), 1.f + static_cast<float>(w));
      psd::ConstTensorView view{value.data(), psd::DType::kFloat32, {elements}, psd::MemoryKind::kHost};
      if (w == 0) {
        psclient::VariableOptions o;
        o.trainable = false;
        for (const auto& name : names) {
          if (!(*c)->CreateVariable(name, view, o).ok()) ++failed;
        }
        created = 1;
      }
      while (!created.load() && !failed.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::vector<psclient::ReduceItem> items;
      for (const auto& name : names) items.push_back({view, name, {}});
      int64_t round = 0;
      const int rounds = opt.warmup + opt.steps;
      auto t0 = Clock::now();
      uint64_t r0 = (*c)->requests_sent();
      for (int i = 0; i < rounds; ++i, ++round) {
        if (i == opt.warmup) {
          t0 = Clock::now();
          r0 = (*c)->requests_sent();
        }
        auto got = (*c)->BatchReduceTo(psclient::ReduceOp::kSum, round, items, {0, opt.token_timeout_ms});
        if (!got.ok()) {
          std::fprintf(stderr, "psd_bench: batch_reduce_to: %s\n", got.status().ToString().c_str());
          ++failed;
          return;
        }
      }
      batch_ms[static_cast<size_t>(w)] =
          std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / opt.steps;
      batch_requests[static_cast<size_t>(w)] = ((*c)->requests_sent() - r0) / static_cast<uint64_t>(opt.steps);
      for (int i = 0; i < rounds; ++i, ++round) {
        if (i == opt.warmup) {
          t0 = Clock::now();
          r0 = (*c)->requests_sent();
        }
        for (const auto& name : names) {
          auto got = (*c)->ReduceTo(psclient::ReduceOp::kSum, round, view, name, {}, opt.token_timeout_ms);
          if (!got.ok()) {
            std::fprintf(stderr, "psd_bench: reduce_to: %s\n", got.status().ToString().c_str());
            ++failed;
            return;
          }
        }
      }
      single_ms[static_cast<size_t>(w)] =
          std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / opt.steps;
      single_requests[static_cast<size_t>(w)] = ((*c)->requests_sent() - r0) / static_cast<uint64_t>(opt.steps);
    });
  }
  for (auto& t : threads) t.join();
  if (failed.load()) return 1;
  double b = 0, s = 0;
  for (int w = 0; w < opt.workers; ++w) {
    b += batch_ms[static_cast<size_t>(w)] / opt.workers;
    s += single_ms[static_cast<size_t>(w)] / opt.workers;
  }
  if (opt.json) {
    std::printf(
        "{\"collectives\": %d, \"elements\": %lld, \"workers\": %d, \"shards\": %d, "
        "\"batch_reduce_to_ms\": %.4f, \"batch_requests\": %llu, \"reduce_to_ms\": %.4f, "
        "\"reduce_to_requests\": %llu, \"ratio\": %.2f}\n",
        n, static_cast<long long>(elements), opt.workers, opt.shards, b,
        static_cast<unsigned long long>(batch_requests[0]), s, static_cast<unsigned long long>(single_requests[0]),
        s / b);
  } else {
    std::printf("collectives: %d tensors of %lld float32 per round, %d worker(s) (replicas), %d shard(s), %d rounds\n",
                n, static_cast<long long>(elements), opt.workers, opt.shards, opt.steps);
    std::printf("  batch_reduce_to        %10.3f ms per round  (%llu request(s) per worker)\n", b,
                static_cast<unsigned long long>(batch_requests[0]));
    std::printf("  %d x reduce_to        %10.3f ms per round  (%llu request(s) per worker)\n", n, s,
                static_cast<unsigned long long>(single_requests[0]));
    std::printf("  batch_reduce_to is %.1fx faster\n", s / b);
  }
  return 0;
}

}  // namespace psd_bench
