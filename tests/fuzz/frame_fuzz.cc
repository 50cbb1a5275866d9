// Fuzz target `frame`: psd's framing and message decoding (common/wire). The input is a byte
// stream as it arrives on a psd port; it is read frame by frame with wire::ReadFrame (segment
// table checks, the size limit before allocation, the reader's traversal and nesting limits),
// and each frame is decoded as a Request and as a Response (what the daemon and the client each
// read), every tensor going through wire::ReadTensor and every placement through
// PlacementFromWire. Nothing may crash, leak or hit undefined behaviour.
#include <cstddef>
#include <cstdint>

#include "service/peer_codec.h"
#include "fuzz_support.h"

namespace {

using psd::proto::Request;
using psd::proto::Response;

constexpr uint64_t kMaxFrameBytes = 1 << 20;
constexpr uint64_t kMaxTensorBytes = 1 << 20;

void CheckTensor(psd::proto::Tensor::Reader t) {
  auto ref = psd::wire::ReadTensor(t, kMaxTensorBytes);
  if (!ref.ok()) return;
  // Touch the data as the engine would: every byte is inside the message.
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < ref->bytes; i += 64) sink = sink ^ ref->data[i];
  (void)sink;
}

void CheckPlacement(psd::proto::VariablePlacement::Reader p) {
  for (int shards : {1, 3}) (void)psd::server::PlacementFromWire(p, shards);
}

void WalkRequest(Request::Reader req) {
  (void)req.totalSize();
  switch (req.which()) {
    case Request::CREATE_VARIABLE: {
      auto c = req.getCreateVariable();
      CheckTensor(c.getInitial());
      CheckPlacement(c.getPlacement());
      break;
    }
    case Request::PUSH:
      for (auto g : req.getPush().getGrads()) CheckTensor(g.getGrad());
      break;
    case Request::REDUCE:
      for (auto e : req.getReduce().getEntries()) CheckTensor(e.getValue());
      break;
    case Request::UPDATE:
      CheckTensor(req.getUpdate().getValue());
      break;
    case Request::PEER: {
      auto m = req.getPeer();
      if (m.isRestored()) {
        for (auto p : m.getRestored().getPlacements()) CheckPlacement(p);
      }
      break;
    }
    default:
      break;
  }
}

void WalkResponse(Response::Reader resp) {
  (void)resp.totalSize();
  (void)psd::wire::FromWire(resp.getCode());
  switch (resp.which()) {
    case Response::PULL:
      for (auto t : resp.getPull().getValues()) CheckTensor(t);
      break;
    case Response::SLOT:
      CheckTensor(resp.getSlot());
      break;
    case Response::PLACEMENT:
      CheckPlacement(resp.getPlacement());
      break;
    case Response::PLACEMENT_MAP:
      for (auto p : resp.getPlacementMap().getVariables()) CheckPlacement(p);
      break;
    case Response::REDUCE:
      for (auto r : resp.getReduce().getResults()) CheckTensor(r.getValue());
      break;
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  psd::fuzz::ForEachFrame(data, size, kMaxFrameBytes, /*max_frames=*/64, [](capnp::MessageReader& reader) {
    // Both decodes share the reader's traversal limit: the second may run out of it (an exception).
    try {
      WalkRequest(reader.getRoot<Request>());
    } catch (const kj::Exception&) {
    }
    WalkResponse(reader.getRoot<Response>());
  });
  return 0;
}
