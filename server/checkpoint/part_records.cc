#include "checkpoint/part_records.h"

#include <cstdint>
#include <string>
#include <utility>

#include "psd/half.h"
#include "psd/tensor.h"

namespace psd::server {
namespace {

constexpr uint8_t kMaxDType = static_cast<uint8_t>(DType::kFloat16);  // the dtypes psd knows: 0..3

}  // namespace

Status BadPart(const std::string& why) { return InvalidArgument("checkpoint part is malformed: " + why); }

Status ParseRecords(RecordReader& r, int version, ShardSnapshot* out) {
  const auto& bad = BadPart;
  uint32_t nvars = 0;
  if (!r.Pod(&out->step) || !r.Pod(&out->learning_rate) || !r.Str(&out->optimizer) || !r.Pod(&nvars)) {
    return bad("header");
  }
  out->variables.clear();
  for (uint32_t i = 0; i < nvars; ++i) {
    VariableSnapshot v;
    uint8_t dtype = 0, trainable = 0, average = 0, has_shadow = 0;
    uint32_t rank = 0, nslots = 0;
    if (!r.Str(&v.name) || !r.Pod(&dtype) || dtype > kMaxDType || !r.Pod(&rank) || rank > 32)
      return bad("variable header");
    v.dtype = static_cast<DType>(dtype);
    for (uint32_t k = 0; k < rank; ++k) {
      int64_t d = 0;
      if (!r.Pod(&d) || d < 0) return bad("shape");
      v.shape.push_back(d);
    }
    if (!r.Pod(&trainable) || !r.Pod(&average) || !r.Str(&v.optimizer) || !r.Blob(&v.value)) return bad("value");
    v.trainable = trainable != 0;
    v.average = average != 0;
    // Half-precision variables are checkpointed as the daemon keeps them: float32 master values.
    // (A shape whose element count overflows is refused before it is multiplied out.)
    if (!ValidateShape(v.shape, ComputeDType(v.dtype), UINT64_MAX).ok()) return bad("shape of '" + v.name + "'");
    uint64_t want = static_cast<uint64_t>(NumElements(v.shape)) * DTypeSize(ComputeDType(v.dtype));
    if (v.value->bytes() != want) return bad("value size of '" + v.name + "'");
    if (!r.Pod(&nslots) || nslots > 16) return bad("slots");
    for (uint32_t k = 0; k < nslots; ++k) {
      std::string name;
      std::shared_ptr<const Buffer> b;
      if (!r.Str(&name) || !r.Blob(&b) || b->bytes() != want) return bad("slot of '" + v.name + "'");
      v.slots.emplace_back(std::move(name), std::move(b));
    }
    if (!r.Pod(&has_shadow)) return bad("shadow");
    if (has_shadow) {
      if (!r.Blob(&v.shadow) || v.shadow->bytes() != want) return bad("shadow of '" + v.name + "'");
    }
    uint8_t placed = 0;
    if (version >= 2 && !r.Pod(&placed)) return bad("placement");
    if (placed) {
      VarPlacement& p = v.placement;
      uint8_t pd = 0, sliced = 0;
      uint32_t prank = 0, nparts = 0;
      if (!r.Str(&p.name) || !r.Pod(&pd) || pd > kMaxDType || !r.Pod(&prank) || prank > 32) return bad("placement");
      p.dtype = static_cast<DType>(pd);
      for (uint32_t k = 0; k < prank; ++k) {
        int64_t d = 0;
        if (!r.Pod(&d) || d < 0) return bad("placement shape");
        p.shape.push_back(d);
      }
      if (!r.Pod(&sliced) || !r.Pod(&nparts) || nparts == 0 || nparts > 4096) return bad("placement parts");
      p.sliced = sliced != 0;
      for (uint32_t k = 0; k < nparts; ++k) {
        int32_t shard = 0;
        SlicePart part;
        if (!r.Pod(&shard) || !r.Pod(&part.row_begin) || !r.Pod(&part.row_end)) return bad("placement part");
        part.shard = shard;
        p.parts.push_back(part);
      }
    }
    if (version >= 3) {
      uint8_t agg = 0, sor = 0;
      if (!r.Pod(&agg) || agg > 3 || !r.Pod(&sor)) return bad("aggregation of '" + v.name + "'");
      v.aggregation = agg;
      v.sync_on_read = sor != 0;
    }
    out->variables.push_back(std::move(v));
  }
  return Status::Ok();
}

void WriteRecords(const ShardSnapshot& snap, RecordWriter* out) {
  RecordWriter& w = *out;
  w.Pod<int64_t>(snap.step);
  w.Pod<double>(snap.learning_rate);
  w.Str(snap.optimizer);
  w.Pod<uint32_t>(static_cast<uint32_t>(snap.variables.size()));
  for (const VariableSnapshot& v : snap.variables) {
    w.Str(v.name);
    w.Pod<uint8_t>(static_cast<uint8_t>(v.dtype));
    w.Pod<uint32_t>(static_cast<uint32_t>(v.shape.size()));
    for (int64_t d : v.shape) w.Pod<int64_t>(d);
    w.Pod<uint8_t>(v.trainable);
    w.Pod<uint8_t>(v.average);
    w.Str(v.optimizer);
    w.Blob(v.value.get());
    w.Pod<uint32_t>(static_cast<uint32_t>(v.slots.size()));
    for (auto& [name, buf] : v.slots) {
      w.Str(name);
      w.Blob(buf.get());
    }
    w.Pod<uint8_t>(v.shadow != nullptr);
    if (v.shadow) w.Blob(v.shadow.get());
    const VarPlacement& p = v.placement;
    w.Pod<uint8_t>(!p.name.empty());
    if (!p.name.empty()) {
      w.Str(p.name);
      w.Pod<uint8_t>(static_cast<uint8_t>(p.dtype));
      w.Pod<uint32_t>(static_cast<uint32_t>(p.shape.size()));
      for (int64_t d : p.shape) w.Pod<int64_t>(d);
      w.Pod<uint8_t>(p.sliced);
      w.Pod<uint32_t>(static_cast<uint32_t>(p.parts.size()));
      for (const SlicePart& part : p.parts) {
        w.Pod<int32_t>(part.shard);
        w.Pod<int64_t>(part.row_begin);
        w.Pod<int64_t>(part.row_end);
      }
    }
    w.Pod<uint8_t>(static_cast<uint8_t>(v.aggregation));
    w.Pod<uint8_t>(v.sync_on_read);
  }
}

}  // namespace psd::server
