// Every libpsclient call that takes a view refuses MemoryKind::kCuda views cleanly where it cannot
// copy them: a CPU-only build answers UNIMPLEMENTED (naming -DPSD_WITH_CUDA=ON); a CUDA build given
// host memory labelled kCuda answers an error too (INVALID_ARGUMENT; FAILED_PRECONDITION without a
// device).
// Nothing is sent or changed, and the connection stays usable. The GPU path itself is tested by
// tests/gpu (label gpu) where a device is at hand.
#include <catch2/catch.hpp>
#include <vector>

#include "support/test_server.h"

using namespace psd;
using psd::testing::ConnectWorker;
using psd::testing::StartServer;
using psd::testing::TestConfig;

namespace {

void CheckRefused(const Status& s, const char* call) {
  INFO(call << ": " << s.ToString());
#ifdef PSD_WITH_CUDA
  CHECK(!s.ok());
  CHECK(s.code() != Code::kUnimplemented);
#else
  CHECK(s.code() == Code::kUnimplemented);
  CHECK_THAT(s.message(), Catch::Contains("-DPSD_WITH_CUDA=ON"));
#endif
}

TensorView Device(std::vector<float>& v, Shape shape) {
  TensorView t{v.data(), DType::kFloat32, std::move(shape), MemoryKind::kCuda};
  t.stream = reinterpret_cast<void*>(0x1);  // never dereferenced: the call refuses first
  return t;
}

}  // namespace

TEST_CASE("every call that takes views refuses device views it cannot copy", "[device]") {
  auto cfg = TestConfig(1, 1, 0);
  cfg.optimizer.name = "adam";
  cfg.optimizer.learning_rate = 0.1;
  cfg.ema_decay = 0.5;
  auto server = StartServer(cfg);
  auto c = ConnectWorker(server->port(), "w");
  std::vector<float> init{1, 2, 3, 4, 5, 6};
  psclient::VariableOptions avg;
  avg.average = true;
  REQUIRE(c->CreateVariable("w", {init.data(), DType::kFloat32, {3, 2}, MemoryKind::kHost}, avg).ok());
  psclient::VariableOptions local;
  local.trainable = false;
  REQUIRE(c->CreateVariable("total", {init.data(), DType::kFloat32, {3, 2}, MemoryKind::kHost}, local).ok());

  std::vector<float> buf(6, 7.f);
  CheckRefused(c->CreateVariable("new", Device(buf, {3, 2})).status(), "CreateVariable");
  CheckRefused(c->Push(0, {{"w", Device(buf, {3, 2})}}).status(), "Push dense");
  psclient::SparseGradient sg{"w", {1}, Device(buf, {1, 2}), {}};
  CheckRefused(c->Push(0, {}, {sg}, false, 0).status(), "Push sparse");
  CheckRefused(c->Pull("w", Device(buf, {3, 2})).status(), "Pull");
  CheckRefused(c->PullRows("w", {0, 2}, Device(buf, {2, 2})).status(), "PullRows");
  CheckRefused(c->PullAverages({{"w", Device(buf, {3, 2})}}).status(), "PullAverages");
  CheckRefused(c->GetSlot("w", "m", Device(buf, {3, 2})), "GetSlot");
  CheckRefused(c->ReduceTo(psclient::ReduceOp::kSum, 0, Device(buf, {3, 2}), "total").status(), "ReduceTo value");
  CheckRefused(c->BroadcastTo(Device(buf, {3, 2}), {"total"}), "BroadcastTo");
  CheckRefused(c->Update("total", psclient::UpdateOp::kAssign, Device(buf, {3, 2})).status(), "Update");
  // A device result: the reduction runs, its result cannot be written.
  std::vector<float> host(6, 1.f);
  CheckRefused(c->ReduceTo(psclient::ReduceOp::kSum, 0, {host.data(), DType::kFloat32, {3, 2}, MemoryKind::kHost},
                           "total", Device(buf, {3, 2}))
                   .status(),
               "ReduceTo result");

  // Nothing was changed on the caller's side or the daemon's, and the connection still works.
  CHECK(buf == std::vector<float>(6, 7.f));
  std::vector<float> w(6);
  auto step = c->Pull("w", {w.data(), DType::kFloat32, {3, 2}, MemoryKind::kHost});
  REQUIRE(step.ok());
  CHECK(*step == 0);
  CHECK(w == init);
  CHECK(!c->Placement("new").ok());
}
