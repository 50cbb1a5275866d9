// The project's GPU test: a trainer whose gradients are computed on the GPU trains through a real
// psd process, pushing from and pulling into device memory on a non-default CUDA stream, while a
// kernel on another stream keeps running; the result must equal, bit for bit, the same training
// done through host memory in the same run.
//
//   gpu_training_test <path to psd> [steps]
//
// Exit status: 0 passed, 1 failed, 77 no CUDA device (ctest SKIP_RETURN_CODE). Built only with
// -DPSD_WITH_CUDA=ON, against libpsclient's public headers only (label gpu; README "GPU trainers").
//
// Each step, for two copies of the same model — "w_dev"/"emb_dev" through device views and
// "w_host"/"emb_host" through host views:
//   - a dense linear regression, w of D = 2^20 + 3 floats (two staging chunks and a tail):
//     gradient kernel on the device, Push from device memory, Pull into device memory;
//   - an embedding table of 64 x 256: PullRows of rows {3, 17, 17, 40} into device memory, a
//     gradient kernel, a sparse Push of those rows (with a duplicate, so coalescing runs) from
//     device memory.
// After the first step (which pins the client's staging buffers) a kernel spins on a second
// stream until the host tells it to stop, after the last step. Every stream here is a blocking
// stream, so a psclient call that synchronized the device or used the legacy default stream would
// wait for that kernel: the kernel would time out (60 s) and the test fail.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "psclient/client.h"

namespace {

using psd::DType;
using psd::MemoryKind;

constexpr int kSkip = 77;
constexpr int kBatch = 4;
constexpr int kDim = (1 << 20) + 3;
constexpr int kRows = 64, kCols = 256;
constexpr float kTarget = 1.0f;
const std::vector<int64_t> kPicked{3, 17, 17, 40};

int failures = 0;

#define EXPECT(cond, what)                                                  \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, what); \
      ++failures;                                                           \
    }                                                                       \
  } while (0)

bool Ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "FAILED: %s: %s\n", what, cudaGetErrorString(err));
  ++failures;
  return false;
}

bool Ok(const psd::Status& s, const char* what) {
  if (s.ok()) return true;
  std::fprintf(stderr, "FAILED: %s: %s\n", what, s.ToString().c_str());
  ++failures;
  return false;
}

// A psd child process on 127.0.0.1 (port from --port-file), stopped with SIGTERM.
class Daemon {
 public:
  bool Start(const std::string& psd) {
    char tmpl[] = "/tmp/psd-gpu-test-XXXXXX";
    if (!mkdtemp(tmpl)) return false;
    dir_ = tmpl;
    std::string port_file = dir_ + "/port";
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      int log = open((dir_ + "/psd.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (log >= 0) dup2(log, 2);
      execl(psd.c_str(), psd.c_str(), "--host", "127.0.0.1", "--port", "0", "--port-file", port_file.c_str(), "-R", "1",
            "--init-tokens", "0", "--learning-rate", "5e-6", "--log-level", "warn", static_cast<char*>(nullptr));
      _exit(127);
    }
    // Bounded: psd writes the file once it listens (a few ms); 20 s is a dead daemon.
    for (int i = 0; i < 2000; ++i) {
      std::ifstream in(port_file);
      int port = 0;
      if (in >> port && port > 0) {
        port_ = static_cast<uint16_t>(port);
        return true;
      }
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::fprintf(stderr, "psd did not start (log: %s/psd.log)\n", dir_.c_str());
    return false;
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      waitpid(pid_, &status, 0);
    }
  }
  uint16_t port() const { return port_; }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  if (!Ok(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc")) std::exit(1);
  if (!Ok(cudaMemset(p, 0, n * sizeof(T)), "cudaMemset")) std::exit(1);
  return static_cast<T*>(p);
}

template <typename T>
T* PinnedAlloc(size_t n, unsigned flags = cudaHostAllocDefault) {
  void* p = nullptr;
  if (!Ok(cudaHostAlloc(&p, n * sizeof(T), flags), "cudaHostAlloc")) std::exit(1);
  std::memset(p, 0, n * sizeof(T));
  return static_cast<T*>(p);
}

psd::TensorView Dev(float* p, psd::Shape shape, cudaStream_t stream) {
  psd::TensorView v{p, DType::kFloat32, std::move(shape), MemoryKind::kCuda};
  v.stream = stream;
  return v;
}

psd::TensorView Host(float* p, psd::Shape shape) { return {p, DType::kFloat32, std::move(shape), MemoryKind::kHost}; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <psd binary> [steps]\n", argv[0]);
    return 1;
  }
  const int steps = argc > 2 ? std::atoi(argv[2]) : 8;
  int devices = 0;
  cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", probe == cudaSuccess ? "0 devices" : cudaGetErrorString(probe));
    return kSkip;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) std::printf("device 0: %s\n", prop.name);

  Daemon psd;
  if (!psd.Start(argv[1])) return 1;
  psclient::ClientOptions options;
  options.port = psd.port();
  options.worker_name = "gpu-worker";
  auto connected = psclient::Client::Connect(options);
  if (!Ok(connected.status(), "Connect")) return 1;
  psclient::Client& c = **connected;

  cudaStream_t train, spin;  // blocking streams (see the file comment)
  if (!Ok(cudaStreamCreate(&train), "cudaStreamCreate") || !Ok(cudaStreamCreate(&spin), "cudaStreamCreate")) return 1;

  // Data: fixed pseudo-random x in [-1, 1) and y, on the device; everything allocated up front.
  std::vector<float> x(static_cast<size_t>(kBatch) * kDim), y(kBatch);
  uint32_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(seed >> 8) / static_cast<float>(1 << 23) - 1.0f;
  };
  for (float& v : x) v = next();
  for (float& v : y) v = 3 * next();
  float* d_x = DeviceAlloc<float>(x.size());
  float* d_y = DeviceAlloc<float>(y.size());
  Ok(cudaMemcpy(d_x, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice), "upload x");
  Ok(cudaMemcpy(d_y, y.data(), y.size() * sizeof(float), cudaMemcpyHostToDevice), "upload y");
  float* d_w_dev = DeviceAlloc<float>(kDim);   // the device run's w
  float* d_w_host = DeviceAlloc<float>(kDim);  // the host run's w, uploaded from h_w
  float* d_grad_dev = DeviceAlloc<float>(kDim);
  float* d_grad_host = DeviceAlloc<float>(kDim);
  float* d_residual = DeviceAlloc<float>(kBatch);
  const size_t picked_n = kPicked.size() * kCols;
  float* d_rows_dev = DeviceAlloc<float>(picked_n);
  float* d_rows_host = DeviceAlloc<float>(picked_n);
  float* d_sgrad_dev = DeviceAlloc<float>(picked_n);
  float* d_sgrad_host = DeviceAlloc<float>(picked_n);
  // The host run's host memory (pinned, so its own staging never involves the legacy stream).
  float* h_w = PinnedAlloc<float>(kDim);
  float* h_grad = PinnedAlloc<float>(kDim);
  float* h_rows = PinnedAlloc<float>(picked_n);
  float* h_sgrad = PinnedAlloc<float>(picked_n);
  float* h_check = PinnedAlloc<float>(kDim);
  float* h_residual = PinnedAlloc<float>(kBatch);
  volatile int* stop = PinnedAlloc<int>(1, cudaHostAllocMapped);
  volatile int* spin_result = PinnedAlloc<int>(1, cudaHostAllocMapped);
  int* d_stop = nullptr;
  int* d_spin_result = nullptr;
  Ok(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_stop), const_cast<int*>(stop), 0), "mapped flag");
  Ok(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_spin_result), const_cast<int*>(spin_result), 0), "mapped");

  // Variables: w zeros; embeddings 0.5 everywhere (created from device memory for the device run).
  std::vector<float> emb_init(static_cast<size_t>(kRows) * kCols, 0.5f);
  float* d_emb_init = DeviceAlloc<float>(emb_init.size());
  Ok(cudaMemcpy(d_emb_init, emb_init.data(), emb_init.size() * sizeof(float), cudaMemcpyHostToDevice), "upload emb");
  Ok(c.CreateVariable("w_dev", Dev(d_w_dev, {kDim}, train)).status(), "CreateVariable w_dev");
  Ok(c.CreateVariable("w_host", Host(h_w, {kDim})).status(), "CreateVariable w_host");
  Ok(c.CreateVariable("emb_dev", Dev(d_emb_init, {kRows, kCols}, train)).status(), "CreateVariable emb_dev");
  Ok(c.CreateVariable("emb_host", Host(emb_init.data(), {kRows, kCols})).status(), "CreateVariable emb_host");
  if (failures) return 1;

  auto loss_of = [&](const float* d_w) {
    float* scratch = d_grad_host;  // overwritten before its next use
    Ok(psd_gpu_test::LinearRegressionGradient(d_x, d_y, d_w, kBatch, kDim, d_residual, scratch, train), "kernel");
    Ok(cudaMemcpyAsync(h_residual, d_residual, kBatch * sizeof(float), cudaMemcpyDeviceToHost, train), "residual");
    Ok(cudaStreamSynchronize(train), "sync");
    double l = 0;
    for (int b = 0; b < kBatch; ++b) l += 0.5 * h_residual[b] * h_residual[b];
    return l / kBatch;
  };
  const double loss_before = loss_of(d_w_dev);

  int64_t local_step = c.initial_global_step();
  bool spinning = false;
  for (int s = 0; s < steps && failures == 0; ++s) {
    // Device run: dense gradient on the device, embedding rows pulled into device memory.
    Ok(psd_gpu_test::LinearRegressionGradient(d_x, d_y, d_w_dev, kBatch, kDim, d_residual, d_grad_dev, train),
       "gradient kernel");
    Ok(c.PullRows("emb_dev", kPicked, Dev(d_rows_dev, {static_cast<int64_t>(kPicked.size()), kCols}, train)).status(),
       "PullRows into device memory");
    Ok(psd_gpu_test::EmbeddingGradient(d_rows_dev, kTarget, static_cast<int>(picked_n), d_sgrad_dev, train),
       "embedding kernel");
    // Host run: the same kernels on the host copies, staged by the test itself.
    Ok(cudaMemcpyAsync(d_w_host, h_w, kDim * sizeof(float), cudaMemcpyHostToDevice, train), "upload w");
    Ok(psd_gpu_test::LinearRegressionGradient(d_x, d_y, d_w_host, kBatch, kDim, d_residual, d_grad_host, train),
       "gradient kernel");
    Ok(cudaMemcpyAsync(h_grad, d_grad_host, kDim * sizeof(float), cudaMemcpyDeviceToHost, train), "download grad");
    Ok(c.PullRows("emb_host", kPicked, Host(h_rows, {static_cast<int64_t>(kPicked.size()), kCols})).status(),
       "PullRows into host memory");
    Ok(cudaMemcpyAsync(d_rows_host, h_rows, picked_n * sizeof(float), cudaMemcpyHostToDevice, train), "upload rows");
    Ok(psd_gpu_test::EmbeddingGradient(d_rows_host, kTarget, static_cast<int>(picked_n), d_sgrad_host, train),
       "embedding kernel");
    Ok(cudaMemcpyAsync(h_sgrad, d_sgrad_host, picked_n * sizeof(float), cudaMemcpyDeviceToHost, train), "download");
    Ok(cudaStreamSynchronize(train), "sync");  // the host run's host buffers are ready

    // One push for both runs: the device run's gradients are read after the kernels queued on
    // `train` (the call orders itself after them; no synchronize above is needed for them).
    psclient::SparseGradient sparse_dev{
        "emb_dev", kPicked, Dev(d_sgrad_dev, {static_cast<int64_t>(kPicked.size()), kCols}, train), {}};
    psclient::SparseGradient sparse_host{
        "emb_host", kPicked, Host(h_sgrad, {static_cast<int64_t>(kPicked.size()), kCols}), {}};
    auto out = c.Push(local_step, {{"w_dev", Dev(d_grad_dev, {kDim}, train)}, {"w_host", Host(h_grad, {kDim})}},
                      {sparse_dev, sparse_host}, /*wait_token=*/true, /*timeout_ms=*/30000);
    if (!Ok(out.status(), "Push")) break;
    if (!Ok(out->token_status, "token")) break;
    EXPECT(out->accepted() == 4, "every gradient accepted");
    local_step = out->token;
    auto step = c.Pull({{"w_dev", Dev(d_w_dev, {kDim}, train)}, {"w_host", Host(h_w, {kDim})}});
    if (!Ok(step.status(), "Pull")) break;
    EXPECT(*step == local_step, "pulled at the token's step");

    if (s == 0) {  // the staging buffers are pinned now: start the other stream's kernel
      Ok(psd_gpu_test::Spin(d_stop, 60ull * 1000 * 1000 * 1000, d_spin_result, spin), "spin kernel");
      spinning = true;
    }
  }
  if (spinning) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *stop = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    Ok(cudaStreamSynchronize(spin), "spin stream");
    EXPECT(*spin_result == 1, "the other stream's kernel ran throughout (a psclient call waited for it)");
  }

  // The two runs agree bit for bit; training worked.
  Ok(cudaMemcpyAsync(h_check, d_w_dev, kDim * sizeof(float), cudaMemcpyDeviceToHost, train), "download w_dev");
  Ok(cudaStreamSynchronize(train), "sync");
  EXPECT(std::memcmp(h_check, h_w, kDim * sizeof(float)) == 0, "w through device memory == w through host memory");
  std::vector<float> emb_a(emb_init.size()), emb_b(emb_init.size());
  float* d_emb = DeviceAlloc<float>(emb_init.size());
  Ok(c.Pull("emb_dev", Dev(d_emb, {kRows, kCols}, train)).status(), "Pull emb_dev into device memory");
  Ok(cudaMemcpyAsync(emb_a.data(), d_emb, emb_a.size() * sizeof(float), cudaMemcpyDeviceToHost, train), "download");
  Ok(cudaStreamSynchronize(train), "sync");
  Ok(c.Pull("emb_host", Host(emb_b.data(), {kRows, kCols})).status(), "Pull emb_host");
  EXPECT(emb_a == emb_b, "embeddings through device memory == through host memory");
  EXPECT(emb_b[3 * kCols] != 0.5f && emb_b[0] == 0.5f, "picked rows trained, others untouched");
  const double loss_after = loss_of(d_w_dev);
  // Figures, not checks: pulls of the same 4 MiB variable into device and into host memory.
  for (int device_view = 1; device_view >= 0; --device_view) {
    constexpr int kReps = 20;
    auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) {
      auto got = device_view ? c.Pull("w_dev", Dev(d_w_dev, {kDim}, train)) : c.Pull("w_host", Host(h_w, {kDim}));
      if (!Ok(got.status(), "timed Pull")) break;
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("pull into %s memory: %.2f GB/s (%d x %.1f MiB, %.2f ms each)\n", device_view ? "device" : "host",
                kReps * kDim * 4.0 / s / 1e9, kReps, kDim * 4.0 / (1 << 20), s / kReps * 1e3);
  }
  std::printf("loss %.6f -> %.6f after %d steps; w %d floats (%.1f MiB) per push and pull\n", loss_before, loss_after,
              steps, kDim, kDim * 4.0 / (1 << 20));
  EXPECT(loss_after < 0.1 * loss_before, "the loss fell tenfold");
  Ok(c.Finish(), "Finish");

  for (float* p : {d_x, d_y, d_w_dev, d_w_host, d_grad_dev, d_grad_host, d_residual, d_rows_dev, d_rows_host,
                   d_sgrad_dev, d_sgrad_host, d_emb_init, d_emb}) {
    cudaFree(p);
  }
  for (void* p : {static_cast<void*>(h_w), static_cast<void*>(h_grad), static_cast<void*>(h_rows),
                  static_cast<void*>(h_sgrad), static_cast<void*>(h_check), static_cast<void*>(h_residual),
                  const_cast<void*>(static_cast<volatile void*>(stop)),
                  const_cast<void*>(static_cast<volatile void*>(spin_result))}) {
    cudaFreeHost(p);
  }
  cudaStreamDestroy(train);
  cudaStreamDestroy(spin);
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
