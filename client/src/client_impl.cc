#include "client_impl.h"

#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "psd/cluster_list.h"

namespace psclient {
namespace internal {

void SetWantedDTypes(const std::vector<std::pair<std::string, TensorView>>& outs,
                     capnp::List<proto::DType>::Builder b) {
  for (size_t i = 0; i < outs.size(); ++i) b.set(static_cast<unsigned>(i), psd::wire::ToWire(outs[i].second.dtype));
}

Status CheckView(const std::string& what, DType want_dtype, const Shape& want_shape, const TensorView& out) {
  if (out.dtype != want_dtype || out.shape != want_shape) {
    return psd::InvalidArgument(what + " is " + psd::DTypeName(want_dtype) + " " + psd::ShapeString(want_shape) +
                                " but the destination view is " + psd::DTypeName(out.dtype) + " " +
                                psd::ShapeString(out.shape));
  }
  if (out.data == nullptr && out.bytes() > 0) return psd::InvalidArgument(what + ": destination view has no data");
  return Status::Ok();
}

Result<VariablePlacement> ReadPlacement(proto::VariablePlacement::Reader r, int shards) {
  VariablePlacement p;
  p.name = r.getName();
  auto dtype = psd::wire::FromWire(r.getDtype());
  if (!dtype.ok()) return dtype.status();
  p.dtype = *dtype;
  for (int64_t d : r.getShape()) p.shape.push_back(d);
  p.sliced = r.getSliced();
  // The map decides which connection a part goes to and where in the caller's memory its rows
  // land: one that names a shard this client has no connection to, or rows that are not exactly
  // the variable's, is refused rather than followed out of bounds.
  auto bad = [&p](const std::string& why) {
    return psd::Internal("psd sent a placement of '" + p.name + "' that " + why +
                         "; the daemon and this client disagree (check that they are one release)");
  };
  for (int64_t d : p.shape) {
    if (d < 0) return bad("has a negative dimension");
  }
  for (auto part : r.getParts()) {
    if (part.getShard() >= static_cast<uint32_t>(shards)) {
      return bad("names shard " + std::to_string(part.getShard()) + " of a cluster of " + std::to_string(shards));
    }
    p.parts.push_back({static_cast<int>(part.getShard()), part.getRowBegin(), part.getRowEnd()});
  }
  if (p.parts.empty()) return bad("has no parts");
  if (!p.sliced) {
    if (p.parts.size() != 1) return bad("has " + std::to_string(p.parts.size()) + " parts but is not sliced");
    return p;
  }
  if (p.shape.empty()) return bad("slices a scalar");
  int64_t next = 0;
  for (const SlicePart& part : p.parts) {
    if (part.row_begin != next || part.row_end < part.row_begin) return bad("has parts that do not tile its rows");
    next = part.row_end;
  }
  if (next != p.shape[0]) return bad("has parts that do not cover its " + std::to_string(p.shape[0]) + " rows");
  return p;
}

void WritePlacement(proto::VariablePlacement::Builder b, const VariablePlacement& p) {
  b.setName(p.name);
  b.setDtype(psd::wire::ToWire(p.dtype));
  auto shape = b.initShape(static_cast<unsigned>(p.shape.size()));
  for (size_t i = 0; i < p.shape.size(); ++i) shape.set(static_cast<unsigned>(i), p.shape[i]);
  b.setSliced(p.sliced);
  auto parts = b.initParts(static_cast<unsigned>(p.parts.size()));
  for (size_t i = 0; i < p.parts.size(); ++i) {
    parts[static_cast<unsigned>(i)].setShard(static_cast<uint32_t>(p.parts[i].shard));
    parts[static_cast<unsigned>(i)].setRowBegin(p.parts[i].row_begin);
    parts[static_cast<unsigned>(i)].setRowEnd(p.parts[i].row_end);
  }
}

}  // namespace internal

using internal::ReadPlacement;

Client::Impl::Impl(ClientOptions options)
    : options_(std::move(options)), copy_pool_(std::clamp(options_.copy_threads, 0, 64)) {
  if (options_.shared_buffer_bytes > 0) {
    auto arena = internal::SharedArena::Create(options_.shared_buffer_bytes);
    if (arena.ok()) {
      arena_ = std::move(*arena);
    } else {
      arena_status_ = arena.status();
    }
  }
  if (options_.cluster.empty()) {
    conns_.push_back(std::make_unique<Conn>(options_, options_.host, options_.port, 0, arena_));
  } else {
    for (size_t i = 0; i < options_.cluster.size(); ++i) {
      // Connect() validated the list.
      psd::HostPort hp = *psd::ParseHostPort(options_.cluster[i]);
      conns_.push_back(std::make_unique<Conn>(options_, hp.host, hp.port, static_cast<int>(i), arena_));
      conns_.back()->quick_reconnect = options_.cluster.size() > 1;
    }
    if (cluster()) {
      probe_options_ = options_;
      probe_options_.observer = true;
      probe_options_.worker_name = options_.worker_name + "/probe";
      probe_options_.shared_memory_bytes = 0;
      probe_options_.shared_buffer_bytes = 0;
      probe_options_.request_timeout_ms = 2000;
      probe_options_.connect_timeout_ms = std::min(options_.connect_timeout_ms, 2000);
      for (int i = 0; i < shards(); ++i) conn(i).stall_check = [this, i] { return CheckStalled(i); };
    }
  }
}

Status Client::Impl::CheckStalled(int k) {
  for (int step = 1; step < shards(); ++step) {
    const int j = (k + step) % shards();  // the next shard first: it would run k's stand-in
    if (!probe_ || probe_->index() != j) {
      probe_ = std::make_unique<Conn>(probe_options_, conn(j).host(), conn(j).port(), j, nullptr);
    }
    OutFrame frame;
    probe_->NewRequest(frame).setStatus();
    proto::Response::Reader resp;
    if ((!probe_->IsOpen() && !probe_->Connect(Conn::kQuickReconnectMs).ok()) ||
        !probe_->RoundTrip(frame, &resp).ok()) {
      probe_.reset();
      continue;  // ask the next one
    }
    try {
      auto s = resp.getStatus();
      auto addresses = s.getShardAddresses();
      if (addresses.size() == static_cast<unsigned>(shards())) {
        auto hp = psd::ParseHostPort(addresses[static_cast<unsigned>(k)].cStr());
        if (hp.ok() && (hp->host != conn(k).host() || hp->port != conn(k).port())) {
          return psd::Unavailable("shard " + std::to_string(k) + " (" + conn(k).Where() +
                                  ") does not answer and the cluster serves it at " +
                                  addresses[static_cast<unsigned>(k)].cStr() + " now; retry");
        }
      }
      bool missing = false;
      for (uint32_t m : s.getMissingShards()) missing = missing || static_cast<int>(m) == k;
      if (missing && std::string(s.getClusterState().cStr()) != "running") {
        return psd::Unavailable("shard " + std::to_string(k) + " (" + conn(k).Where() +
                                ") does not answer and the cluster counts it gone: " + s.getClusterState().cStr() +
                                "; retry");
      }
    } catch (const kj::Exception&) {
      probe_.reset();
      continue;
    }
    return Status::Ok();
  }
  return Status::Ok();  // no other shard answers: wait on
}
Status Client::Impl::ConnectAll() {
  // A cluster's shards are tried briefly first: one that does not answer may be served elsewhere
  // now (a stand-in after a takeover), which the others say. Those still unreached then get the
  // whole connect_timeout_ms (a cluster that is starting).
  int reached = 0;
  std::vector<Conn*> failed;
  for (auto& c : conns_) {
    Status s = c->Connect(cluster() ? Conn::kQuickReconnectMs : 0);
    if (!s.ok() && cluster()) {
      failed.push_back(c.get());
      continue;
    }
    if (!s.ok()) return FromShard(s, *c, cluster());
    ++reached;
    PSD_RETURN_IF_ERROR(CheckShardCount(*c));
  }
  if (reached > 0 && !failed.empty()) RefreshChief();  // where the shards are served now
  Status first;
  for (Conn* c : failed) {
    if (c->IsOpen()) continue;  // RefreshChief reached it
    Status s = c->Connect();
    if (!s.ok()) {
      // An operator's tool looks at whatever answers (the shards left when one is down).
      if (options_.observer) {
        if (first.ok()) first = FromShard(s, *c, cluster());
        continue;
      }
      return FromShard(s, *c, cluster());
    }
    ++reached;
    PSD_RETURN_IF_ERROR(CheckShardCount(*c));
  }
  if (reached == 0) return first;
  // The chief as the shards see it; its handshake has the worker's identity and role.
  int chief = -1;
  for (auto& c : conns_) {
    if (c->connects > 0 && c->chief_shard >= 0) {
      chief = c->chief_shard;
      break;
    }
  }
  chief_ = chief >= 0 && chief < static_cast<int>(conns_.size()) ? chief : 0;
  if (cluster() && !options_.observer) PSD_RETURN_IF_ERROR(WaitUntilServing());
  Conn& c = *conns_[static_cast<size_t>(chief_.load())];
  is_chief_ = c.is_chief;
  cluster_epoch_ = c.cluster_epoch;
  return Status::Ok();
}

Status Client::Impl::CheckShardCount(const Conn& c) const {
  if (c.shards_reported != static_cast<int>(conns_.size()) && !options_.observer) {
    return psd::InvalidArgument("psd at " + c.Where() + " is part of a cluster of " +
                                std::to_string(c.shards_reported) + " shard(s), the client was given " +
                                std::to_string(conns_.size()) + ": list every shard in ClientOptions::cluster");
  }
  return Status::Ok();
}

Status Client::Impl::WaitUntilServing() {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.connect_timeout_ms);
  std::string state = "no answer";
  for (;;) {
    RefreshChief();
    proto::Response::Reader resp;
    if (AskStatus(chief_.load(), &resp).ok()) {
      try {
        auto s = resp.getStatus();
        state = s.getClusterState();
        if (state == "running" && s.getChiefShard() == chief_.load()) {
          chief().is_chief = s.getIsChief();
          chief().cluster_epoch = s.getClusterEpoch();
          // The other shards serve once the chief's heartbeat reaches them, just after: a worker's
          // first request to one of them must not be refused meanwhile.
          std::string waiting = OthersServing(s.getClusterEpoch());
          if (waiting.empty()) return Status::Ok();
          state = waiting;
        }
      } catch (const kj::Exception&) {
        state = "shard " + std::to_string(chief_.load()) + " answered the status request with something else";
      }
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return psd::Unavailable("the psd cluster does not serve yet (" + state + "); retry");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status Client::Impl::AskStatus(int shard, proto::Response::Reader* resp) {
  OutFrame frame;
  conn(shard).NewRequest(frame).setStatus();
  return Single(shard, frame, resp);
}

std::string Client::Impl::OthersServing(uint64_t epoch) {
  for (int k = 0; k < static_cast<int>(conns_.size()); ++k) {
    if (k == chief_.load()) continue;
    proto::Response::Reader resp;
    if (!AskStatus(k, &resp).ok()) return "shard " + std::to_string(k) + " does not answer";
    try {
      auto s = resp.getStatus();
      if (!s.getReady() || s.getClusterEpoch() != epoch) {
        return "shard " + std::to_string(k) + ": " + std::string(s.getClusterState().cStr());
      }
    } catch (const kj::Exception&) {
      return "shard " + std::to_string(k) + " answered the status request with something else";
    }
  }
  return "";
}

bool Client::Impl::AppliesOnArrival() const {
  if (!cluster()) return false;
  const Conn& c = chief();
  std::lock_guard<std::mutex> lock(c.hello_mu);
  return c.config.mode == "async" || c.config.mode == "ssp";
}

Status Client::Impl::Run(Calls& calls, const std::function<void(size_t)>& each) {
  // A frame psd would refuse for its size fails the batch before any frame goes out: the frames
  // before it (a push's first chunks) would otherwise be added without the rest. (A shard not
  // connected yet says its limit at hello: Send checks again.)
  for (auto& c : calls) {
    Status fits = conn(c->shard).CheckFrameSize(c->frame);
    if (!fits.ok()) return FromShard(fits, conn(c->shard), cluster());
  }
  // A shard whose earlier frame of this batch failed gets no more (its stream is reset).
  std::vector<bool> failed(conns_.size(), false);
  // Per shard, the calls sent whose replies are unread (oldest first) and the bytes those may hold.
  // psd reads no further request from a connection while more than --max-queued-reply-bytes of
  // replies wait for it, and this thread reads nothing while it writes: a request is sent only once
  // what is unread fits Conn::ReplyWindow (half psd's hold), else a big lookup's requests would
  // wait behind replies nobody reads.
  std::vector<std::deque<size_t>> unread(conns_.size());
  std::vector<uint64_t> unread_bytes(conns_.size(), 0);
  std::vector<bool> done(calls.size(), false);
  auto cost = [](const Call& c) { return c.reply_bytes + Conn::kReplyOverhead; };
  auto receive = [&](size_t i) {
    Call& c = *calls[i];
    const size_t k = static_cast<size_t>(c.shard);
    c.status = FromShard(conn(c.shard).Receive(c.frame, &c.resp, c.landing.dst ? &c.landing : nullptr), conn(c.shard),
                         cluster());
    // A reply that broke the stream: the rest of the batch is not sent there.
    if (!c.status.ok() && !conn(c.shard).IsOpen()) failed[k] = true;
    done[i] = true;
    if (each) each(i);
  };
  for (size_t i = 0; i < calls.size(); ++i) {
    auto& c = calls[i];
    const size_t k = static_cast<size_t>(c->shard);
    while (!failed[k] && !unread[k].empty() && unread_bytes[k] + cost(*c) > conn(c->shard).ReplyWindow()) {
      const size_t oldest = unread[k].front();
      unread[k].pop_front();
      unread_bytes[k] -= cost(*calls[oldest]);
      receive(oldest);
    }
    if (!failed[k]) {
      for (const Call::ShmCopy& cp : c->copies) copy_pool_.ParallelCopy(cp.dst, cp.src, cp.bytes);
    }
    c->status = failed[k] ? psd::Unavailable("an earlier frame to this shard failed")
                          : FromShard(conn(c->shard).Send(c->frame, c->wait_ms), conn(c->shard), cluster());
    c->sent = c->status.ok();
    failed[k] = failed[k] || !c->sent;
    if (c->sent) {
      unread[k].push_back(i);
      unread_bytes[k] += cost(*c);
    }
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    if (done[i]) continue;
    if (calls[i]->sent) {
      receive(i);
    } else if (each) {
      each(i);
    }
  }
  // The most telling error first: a shard's own answer (it says what the cluster waits for)
  // before a transport failure (a shard that is gone).
  Status first;
  for (int pass = 0; pass < 2 && first.ok(); ++pass) {
    for (auto& c : calls) {
      if (pass == 0 && c->status.code() == Code::kAborted) NoteRestored();
      bool answered = c->sent && conn(c->shard).last_answered();
      if (first.ok() && !c->status.ok() && (pass == 1 || answered)) first = c->status;
    }
  }
  // Not now: the replies' readers must stay valid until the caller has read them.
  if (!first.ok() && cluster() && (first.code() == Code::kUnavailable || first.code() == Code::kFailedPrecondition)) {
    refresh_chief_ = true;
  }
  return first;
}

Result<SharedBuffer> Client::Impl::NewShared(size_t bytes) {
  if (!arena_) {
    if (!arena_status_.ok()) return arena_status_;
    return psd::FailedPrecondition("no shared buffers: ClientOptions::shared_buffer_bytes is 0");
  }
  auto at = arena_->Allocate(bytes);
  if (!at.ok()) return at.status();
  SharedBuffer b;
  b.arena_ = arena_;
  b.offset_ = *at;
  b.bytes_ = bytes;
  return b;
}

void Client::Impl::RefreshChief() {
  uint64_t best_term = 0;
  int best = -1;
  std::vector<std::string> addresses;
  // The shards connected now first: a lost one is tried (briefly) only if none of them knows a chief.
  for (int pass = 0; pass < 2 && best < 0; ++pass) {
    for (int i = 0; i < shards(); ++i) {
      if (conn(i).IsOpen() != (pass == 0)) continue;
      OutFrame frame;
      conn(i).NewRequest(frame).setStatus();
      proto::Response::Reader resp;
      if (!conn(i).RoundTrip(frame, &resp).ok()) continue;
      try {
        auto s = resp.getStatus();
        if (s.getChiefShard() >= 0 && (best < 0 || s.getTerm() > best_term)) {
          best = s.getChiefShard();
          best_term = s.getTerm();
          addresses.clear();
          for (auto a : s.getShardAddresses()) addresses.emplace_back(a.cStr());
        }
      } catch (const kj::Exception&) {
        continue;  // a malformed answer tells nothing about the chief
      }
    }
  }
  if (best >= 0 && best < shards()) chief_ = best;
  // Where each shard is served now: a stand-in's address after a takeover, or its own again.
  if (addresses.size() == conns_.size()) {
    for (size_t i = 0; i < addresses.size(); ++i) {
      auto hp = psd::ParseHostPort(addresses[i]);
      if (hp.ok() && hp->port != 0) conns_[i]->Retarget(hp->host, hp->port);
    }
  }
}

Result<VariablePlacement> Client::Impl::Locate(const std::string& name) {
  if (!cluster()) return VariablePlacement{name, DType::kFloat32, {}, false, {{0, 0, 0}}};
  auto it = placements_.find(name);
  if (it != placements_.end()) return it->second;
  auto map = FetchMap();
  if (!map.ok()) return map.status();
  for (auto& p : map->variables) placements_[p.name] = p;
  it = placements_.find(name);
  if (it == placements_.end()) return psd::NotFound("no variable named '" + name + "'");
  return it->second;
}

Result<PlacementMap> Client::Impl::FetchMap() {
  for (int attempt = 0; attempt < 2; ++attempt) {
    OutFrame frame;
    chief().NewRequest(frame).setGetPlacement();
    proto::Response::Reader resp;
    Status s = Single(chief_.load(), frame, &resp);
    if (s.ok()) {
      try {
        PlacementMap m;
        auto pm = resp.getPlacementMap();
        for (auto v : pm.getVariables()) {
          auto p = ReadPlacement(v, shards());
          if (!p.ok()) return p.status();
          m.variables.push_back(std::move(*p));
        }
        for (uint64_t b : pm.getShardBytes()) m.shard_bytes.push_back(b);
        return m;
      } catch (const kj::Exception& e) {
        return Malformed(e);
      }
    }
    if (!cluster() || attempt == 1) return s;
    RefreshChief();
  }
  return psd::Internal("unreachable");
}

}  // namespace psclient
