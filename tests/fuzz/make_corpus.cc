// psd_fuzz_corpus: writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/),
// valid frames of every request and peer message kind built with the schema's own builders, so
// the seeds follow the schema (worker_request seeds start with worker_fuzz.cc's settings byte). `psd_fuzz_corpus DIR`
// (re)writes DIR/<target>/*; `--check DIR` exits 1, naming the files, when DIR differs from what it would write (the
// fuzz.corpus_current test: a schema change without regenerated seeds).
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "psd.capnp.h"

namespace {

namespace fs = std::filesystem;
using psd::proto::PeerMessage;
using psd::proto::Request;
using Bytes = std::string;

// One frame holding a Request built by `fill`.
Bytes Frame(uint64_t id, const std::function<void(Request::Builder)>& fill) {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<Request>();
  req.setId(id);
  fill(req);
  auto words = capnp::messageToFlatArray(msg);
  auto bytes = words.asBytes();
  return Bytes(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
}

void SetTensor(psd::proto::Tensor::Builder t, std::initializer_list<int64_t> shape, float fill) {
  t.setDtype(psd::proto::DType::FLOAT32);
  auto s = t.initShape(static_cast<unsigned>(shape.size()));
  size_t n = 1;
  unsigned i = 0;
  for (int64_t d : shape) {
    s.set(i++, d);
    n *= static_cast<size_t>(d);
  }
  std::vector<float> v(n, fill);
  auto data = t.initData(static_cast<unsigned>(n * sizeof(float)));
  std::memcpy(data.begin(), v.data(), n * sizeof(float));
}

Bytes Hello(bool observer = false) {
  return Frame(1, [&](Request::Builder r) {
    auto h = r.initHello();
    h.setProtocolVersion(psd::proto::PROTOCOL_VERSION);
    h.setWorkerName("worker-0");
    h.setIncarnation(1);
    h.setObserver(observer);
  });
}

Bytes Create(const char* name = "w", bool sync_on_read = false) {
  return Frame(2, [&](Request::Builder r) {
    auto c = r.initCreateVariable();
    c.setName(name);
    SetTensor(c.initInitial(), {4, 2}, 0.5f);
    c.setAverage(true);
    if (sync_on_read) {
      c.setSyncOnRead(true);
      c.setAggregation(psd::proto::Aggregation::MEAN);
    }
  });
}

Bytes Push(bool sparse) {
  return Frame(3, [&](Request::Builder r) {
    auto p = r.initPush();
    p.setLocalStep(0);
    p.setWaitToken(true);
    p.setTimeoutMs(10);
    p.initPullAfter(1).set(0, "w");
    auto g = p.initGrads(1)[0];
    g.setName("w");
    if (sparse) {
      g.setSparse(true);
      SetTensor(g.initGrad(), {2, 2}, 1.0f);
      auto idx = g.initIndices(2);
      idx.set(0, 0);
      idx.set(1, 3);
      g.setHasDenseShape(true);
      auto ds = g.initDenseShape(2);
      ds.set(0, 4);
      ds.set(1, 2);
    } else {
      SetTensor(g.initGrad(), {4, 2}, 1.0f);
    }
  });
}

// A push sent in two frames: a chunk of w (all of its 8 elements, as the last chunk), `more` set;
// then the frame with the token wait.
Bytes ChunkedPush() {
  Bytes first = Frame(3, [&](Request::Builder r) {
    auto p = r.initPush();
    p.setLocalStep(0);
    p.setMore(true);
    auto g = p.initGrads(1)[0];
    g.setName("w");
    g.setChunk(true);
    g.setChunkOffset(0);
    SetTensor(g.initGrad(), {8}, 1.0f);
  });
  return first + Push(false);
}

// A worker session: hello, a variable, then `rest`, then finish.
Bytes Session(std::initializer_list<Bytes> rest) {
  Bytes out = Hello() + Create();
  for (const Bytes& b : rest) out += b;
  return out + Frame(99, [](Request::Builder r) { r.setFinish(); });
}

std::map<std::string, Bytes> WorkerSeeds() {
  std::map<std::string, Bytes> s;
  s["hello"] = Hello();
  s["hello_observer_status"] = Hello(true) + Frame(2, [](Request::Builder r) { r.setStatus(); });
  s["no_hello"] = Create();
  s["create"] = Session({});
  s["create_sync_on_read"] = Hello() + Create("r", true);
  s["pull"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPull();
    p.initNames(1).set(0, "w");
    p.setAverages(true);
  })});
  s["pull_ranges"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPull();
    auto names = p.initNames(2);
    names.set(0, "w");
    names.set(1, "w");
    auto ranges = p.initRanges(2);
    ranges[0].setOffset(0);
    ranges[0].setCount(3);
    ranges[1].setOffset(3);
    ranges[1].setCount(5);
  })});
  s["push_dense"] = Session({Push(false)});
  s["push_sparse"] = Session({Push(true)});
  s["push_chunks"] = Session({ChunkedPush()});
  // Tensors said to be in a shared-memory segment (none is attached over a byte stream).
  s["push_shm"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPush();
    auto g = p.initGrads(1)[0];
    g.setName("w");
    auto t = g.initGrad();
    t.setDtype(psd::proto::DType::FLOAT32);
    t.initShape(1).set(0, 8);
    t.setInShm(true);
    t.setShmOffset(64);
  })});
  s["pull_shm"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPull();
    p.initNames(1).set(0, "w");
    p.initToShm().setOffset(0);
    p.getToShm().setBytes(64);
  })});
  // A pull that takes its values in place (the daemon's values segment) and says what it read;
  // a gradient said to be there (workers never push from it).
  s["pull_values_in_place"] = Session({Frame(3, [](Request::Builder r) {
    r.setValuesRead(2);
    auto p = r.initPull();
    p.initNames(1).set(0, "w");
    p.initToShm().setOffset(0);
    p.getToShm().setBytes(64);
    p.getToShm().setValues(true);
  })});
  s["values_ack"] = Session({Frame(0, [](Request::Builder r) {
    r.setValuesRead(3);
    r.setValuesAck();
  })});
  s["push_values_segment"] = Session({Frame(3, [](Request::Builder r) {
    auto t = r.initPush().initGrads(1)[0].initGrad();
    t.setDtype(psd::proto::DType::FLOAT32);
    t.initShape(1).set(0, 8);
    t.setInShm(true);
    t.setShmSegment(2);
  })});
  s["push_buffers"] = Session({Frame(3, [](Request::Builder r) {
    auto t = r.initPush().initGrads(1)[0].initGrad();
    t.setDtype(psd::proto::DType::FLOAT32);
    t.initShape(1).set(0, 8);
    t.setInShm(true);
    t.setShmOffset(128);
    t.setShmSegment(1);
  })});
  s["pull_buffers"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPull();
    p.initNames(1).set(0, "w");
    p.initToShm().setSegment(1);
    p.getToShm().initOffsets(1).set(0, 256);
  })});
  s["wait_token"] = Session({Frame(3, [](Request::Builder r) { r.initWaitToken().setTimeoutMs(10); })});
  s["get_slot"] = Session({Frame(3, [](Request::Builder r) {
    auto g = r.initGetSlot();
    g.setVariable("w");
    g.setSlot("momentum");
  })});
  s["pull_rows"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPullRows();
    p.setName("w");
    auto rows = p.initRows(3);
    rows.set(0, 3);
    rows.set(1, 0);
    rows.set(2, 3);
  })});
  s["pull_rows_buffers"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPullRows();
    p.setName("w");
    auto rows = p.initRows(2);
    rows.set(0, 1);
    rows.set(1, 0);
    p.initToShm().setSegment(1);
    auto at = p.getToShm().initOffsets(2);
    at.set(0, 256);
    at.set(1, 64);
  })});
  s["pull_rows_segment"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPullRows();
    p.setName("w");
    p.initRows(1).set(0, 2);
    p.initToShm().setOffset(128);
    p.getToShm().setBytes(4096);
  })});
  s["set_learning_rate"] = Session({Frame(3, [](Request::Builder r) { r.setSetLearningRate(0.5); })});
  s["checkpoint"] = Session({Frame(3, [](Request::Builder r) { r.setCheckpoint(); })});
  s["place"] = Session({Frame(3, [](Request::Builder r) {
    auto p = r.initPlace();
    p.setName("p");
    p.initShape(1).set(0, 8);
  })});
  s["get_placement"] = Session({Frame(3, [](Request::Builder r) { r.setGetPlacement(); })});
  s["peer_without_hello"] = Session({Frame(3, [](Request::Builder r) { r.initPeer().initHeartbeat(); })});
  s["reduce"] = Session({Frame(3, [](Request::Builder r) {
    auto red = r.initReduce();
    red.setOp(psd::proto::Reduction::SUM);
    red.setTimeoutMs(10);
    auto e = red.initEntries(1)[0];
    e.setDestination("w");
    SetTensor(e.initValue(), {4, 2}, 2.0f);
  })});
  s["update"] = Session({Frame(3, [](Request::Builder r) {
    auto u = r.initUpdate();
    u.setVariable("w");
    u.setOp(psd::proto::UpdateOp::ASSIGN_ADD);
    SetTensor(u.initValue(), {4, 2}, 1.0f);
    u.setCrossReplica(true);
    u.setTimeoutMs(10);
  })});
  // An update of w in two chunks (elements 0..4, more; then 4..8).
  auto update_chunk = [](int64_t offset, bool more) {
    return Frame(3, [=](Request::Builder r) {
      auto u = r.initUpdate();
      u.setVariable("w");
      u.setOp(psd::proto::UpdateOp::ASSIGN);
      u.setCrossReplica(true);
      u.setChunked(true);
      u.setChunkOffset(offset);
      auto shape = u.initChunkedShape(2);
      shape.set(0, 4);
      shape.set(1, 2);
      u.setMore(more);
      SetTensor(u.initValue(), {4}, 2.0f);
    });
  };
  s["update_chunks"] = Session({update_chunk(0, true), update_chunk(4, false)});
  // A sparse gradient of w in two frames of one push: row 0 (rowsMore, more), then row 3.
  auto sparse_rows = [](int64_t row, bool more) {
    return Frame(3, [=](Request::Builder r) {
      auto p = r.initPush();
      p.setMore(more);
      auto g = p.initGrads(1)[0];
      g.setName("w");
      g.setSparse(true);
      g.setRowsMore(more);
      SetTensor(g.initGrad(), {1, 2}, 1.0f);
      g.initIndices(1).set(0, row);
    });
  };
  s["push_sparse_rows"] = Session({sparse_rows(0, true), sparse_rows(3, false)});
  s["steps"] = Session({Push(false), Push(false), Push(true),
                        Frame(7, [](Request::Builder r) { r.initPull().initNames(1).set(0, "w"); })});
  return s;
}

// A peer message from shard `from` at `term`, sent by that shard's one process (its incarnation,
// 0x100 + from: the orders that follow a heartbeat come from the process the heartbeat named).
Bytes Peer(uint32_t from, uint64_t term, const std::function<void(PeerMessage::Builder)>& fill) {
  return Frame(0, [&](Request::Builder r) {
    auto m = r.initPeer();
    m.setFrom(from);
    m.setTerm(term);
    m.setSender(0x100 + from);
    fill(m);
  });
}

Bytes Heartbeat(uint32_t from, uint64_t term, int32_t chief, bool running) {
  return Peer(from, term, [&](PeerMessage::Builder m) {
    auto hb = m.initHeartbeat();
    hb.setChief(chief);
    hb.setEpoch(term);
    hb.setRunning(running);
    hb.setReady(true);
    hb.setRequired(1);
    hb.initSealedSteps(1).set(0, 10);
  });
}

// A manifest of 3 parts of `step`, written in epoch `epoch`, of `bytes` each.
void SealParts(capnp::List<psd::proto::PeerPart>::Builder parts, uint64_t epoch, int64_t step, uint64_t bytes) {
  for (unsigned k = 0; k < parts.size(); ++k) {
    parts[k].setEpoch(epoch);
    parts[k].setStep(step);
    parts[k].setShard(k);
    parts[k].setFile("shard-" + std::to_string(k) + "-of-3.psdckpt");
    parts[k].setBytes(bytes);
    parts[k].setChecksum(0x1234 + k);
  }
}

Bytes Restore(uint32_t from, uint64_t term, int64_t step) {
  return Peer(from, term, [&](PeerMessage::Builder m) {
    auto r = m.initRestore();
    r.setEpoch(term);
    r.setStep(step);
  });
}

Bytes Restored(uint32_t from, uint64_t term) {
  return Peer(from, term, [&](PeerMessage::Builder m) {
    auto r = m.initRestored();
    r.setEpoch(term);
    r.setStep(-1);
    r.setOk(true);
    auto p = r.initPlacements(1)[0];
    p.setName("w");
    p.initShape(2).set(0, 8);
    p.getShape().set(1, 2);
    p.setSliced(true);
    auto parts = p.initParts(2);
    parts[0].setShard(from);
    parts[0].setRowBegin(0);
    parts[0].setRowEnd(4);
    parts[1].setShard(0);
    parts[1].setRowBegin(4);
    parts[1].setRowEnd(8);
  });
}

Bytes Step(uint32_t from, uint64_t term, int64_t step, bool committed) {
  return Peer(from, term, [&](PeerMessage::Builder m) {
    auto s = committed ? m.initCommitted() : m.initPrepared();
    s.setEpoch(term);
    s.setStep(step);
    s.setMinGradients(1);
    s.setMaxGradients(2);
    s.setTakes(1);
  });
}

Bytes Part(uint32_t from, uint64_t term, int64_t step) {
  return Peer(from, term, [&](PeerMessage::Builder m) {
    auto p = m.initPartWritten();
    p.setEpoch(term);
    p.setStep(step);
    p.setShard(from);
    p.setFile("part-1-of-3");
    p.setBytes(128);
    p.setChecksum(0x1234);
  });
}

std::map<std::string, Bytes> PeerSeeds() {
  std::map<std::string, Bytes> s;
  // Shard 1 is chief at term 5 (a higher term than ours: adopted), then drives shard 0.
  s["heartbeat"] = Heartbeat(1, 5, 1, true);
  s["follower_restore"] = Heartbeat(1, 5, 1, false) + Restore(1, 5, -1);
  s["follower_restore_step"] = Heartbeat(1, 5, 1, false) + Restore(1, 5, 10);
  // A restore order with the chief's map: shard 2 is served by a stand-in.
  s["follower_restore_moved"] = Heartbeat(1, 5, 1, false) + Peer(1, 5, [](PeerMessage::Builder m) {
                                  auto r = m.initRestore();
                                  r.setEpoch(5);
                                  r.setStep(-1);
                                  auto moved = r.initMoved(1);
                                  moved[0].setShard(2);
                                  moved[0].setAddress("127.0.0.1:9002");
                                });
  // Replication (the target runs --replicas-per-shard 2; shard 0's predecessor is 2, its successor 1).
  auto chunk = [](uint32_t from, uint32_t owner, bool restore, uint64_t offset, uint64_t total, size_t size,
                  bool hand_back = false) {
    return Peer(from, 5, [&](PeerMessage::Builder m) {
      auto c = m.initReplicaChunk();
      c.setEpoch(5);
      c.setOwner(owner);
      c.initCopy().setLineage(4);
      c.getCopy().setStep(10);
      c.setRestore(restore);
      c.setOffset(offset);
      c.setTotal(total);
      c.setHandBack(hand_back);
      auto data = c.initData(static_cast<unsigned>(size));
      for (size_t i = 0; i < size; ++i) data[i] = static_cast<uint8_t>(i * 7);
    });
  };
  s["replica_chunks"] = Heartbeat(1, 5, 1, true) + chunk(2, 2, false, 0, 96, 48) + chunk(2, 2, false, 48, 96, 48);
  // A stand-in's host hands back the copies of shard 2's part it kept (from shard 1), and shard 2
  // answers a hand-back of shard 0's.
  s["replica_hand_back"] = Heartbeat(1, 5, 1, true) + chunk(1, 2, false, 0, 64, 64, /*hand_back=*/true) +
                           Peer(2, 5, [](PeerMessage::Builder m) {
                             auto a = m.initReplicaAck();
                             a.setEpoch(5);
                             a.initCopy().setLineage(4);
                             a.getCopy().setStep(10);
                             a.setHandBack(true);
                           });
  s["replica_heartbeat_copies"] = Peer(1, 5, [](PeerMessage::Builder m) {
    auto hb = m.initHeartbeat();
    hb.setChief(1);
    hb.setEpoch(5);
    hb.setReady(true);
    auto own = hb.initOwnCopies(2);
    own[0].setLineage(4);
    own[0].setStep(10);
    own[1].setLineage(4);
    own[1].setStep(9);
    auto held = hb.initHeldCopies(1);
    held[0].setLineage(4);
    held[0].setStep(10);
  });
  // A shard that missed a seal (step 12 unusable, with its part's size and checksum), and the
  // copies it heard are kept; the manifest of its newest sealed step (8) goes along.
  s["heartbeat_unsealed_parts"] = Peer(1, 5, [](PeerMessage::Builder m) {
    auto hb = m.initHeartbeat();
    hb.setChief(1);
    hb.setEpoch(5);
    hb.setReady(true);
    hb.initSealedSteps(1).set(0, 8);
    hb.initUnusableSteps(1).set(0, 12);
    auto parts = hb.initUnsealedParts(1);
    parts[0].setStep(12);
    parts[0].setShard(1);
    parts[0].setFile("shard-1-of-3.psdckpt");
    parts[0].setBytes(4096);
    parts[0].setChecksum(0x1234abcd);
    auto kept = hb.initKeptCopies(3);  // async/ssp replicas: each part's newest copy kept
    for (unsigned i = 0; i < 3; ++i) {
      kept[i].setLineage(4);
      kept[i].setStep(10 + i);
    }
    auto seal = hb.initNewestSeal();
    seal.setStep(8);
    SealParts(seal.initParts(3), 4, 8, 4096);
  });
  // Takeover: a stand-in's heartbeat (its address), then the chief's map moving shard 2 there.
  s["takeover_stand_in_moved"] = Peer(2, 5,
                                      [](PeerMessage::Builder m) {
                                        auto hb = m.initHeartbeat();
                                        hb.setChief(1);
                                        hb.setEpoch(5);
                                        hb.setReady(true);
                                        hb.setAddress("127.0.0.1:40123");
                                        hb.setStandIn(true);
                                      }) +
                                 Peer(1, 5, [](PeerMessage::Builder m) {
                                   auto hb = m.initHeartbeat();
                                   hb.setChief(1);
                                   hb.setEpoch(5);
                                   hb.setReady(true);
                                   hb.setAddress("127.0.0.1:40001");
                                   auto moved = hb.initMoved(1);
                                   moved[0].setShard(2);
                                   moved[0].setAddress("127.0.0.1:40123");
                                 });
  // A live restore: shard 0 keeps no copy, fetches it from shard 1, which answers it holds none.
  s["replica_live_restore"] = Heartbeat(1, 5, 1, false) +
                              Peer(1, 5,
                                   [](PeerMessage::Builder m) {
                                     auto r = m.initRestore();
                                     r.setEpoch(5);
                                     r.setStep(10);
                                     r.setLive(true);
                                     r.setLineage(4);
                                   }) +
                              chunk(1, 0, true, 0, 0, 0);
  // Async/ssp: a restore of each part's newest copy (shard 0 keeps none: it asks its successor for
  // a newer one, which has none), and the predecessor asking for one newer than its own.
  s["replica_newest_restore"] = Heartbeat(1, 5, 1, false) +
                                Peer(1, 5,
                                     [](PeerMessage::Builder m) {
                                       auto r = m.initRestore();
                                       r.setEpoch(5);
                                       r.setStep(37);
                                       r.setLive(true);
                                       r.setLineage(4);
                                       r.setNewest(true);
                                     }) +
                                chunk(1, 0, true, 0, 0, 0) + Peer(2, 5, [](PeerMessage::Builder m) {
                                  auto f = m.initReplicaFetch();
                                  f.setEpoch(5);
                                  f.initCopy().setLineage(4);
                                  f.getCopy().setStep(9);
                                  f.setNewest(true);
                                });
  s["replica_ack_fetch"] = Heartbeat(1, 5, 1, true) +
                           Peer(1, 5,
                                [](PeerMessage::Builder m) {
                                  auto a = m.initReplicaAck();
                                  a.setEpoch(5);
                                  a.initCopy().setLineage(4);
                                }) +
                           Peer(2, 5, [](PeerMessage::Builder m) {
                             auto f = m.initReplicaFetch();
                             f.setEpoch(5);
                             f.initCopy().setLineage(4);
                             f.getCopy().setStep(10);
                           });
  // A restore that carries the seal of its step (for a shard that missed it).
  s["follower_restore_seal"] = Heartbeat(1, 5, 1, false) + Peer(1, 5, [](PeerMessage::Builder m) {
                                 auto r = m.initRestore();
                                 r.setEpoch(5);
                                 r.setStep(10);
                                 SealParts(r.initSeal(3), 5, 10, 128);
                               });
  s["follower_commit"] = Heartbeat(1, 5, 1, true) + Peer(1, 5, [](PeerMessage::Builder m) {
                           auto c = m.initCommit();
                           c.setEpoch(5);
                           c.setStep(0);
                           c.setLearningRate(0.1);
                         });
  s["follower_control"] = Heartbeat(1, 5, 1, true) + Peer(1, 5, [](PeerMessage::Builder m) {
                            auto c = m.initControl();
                            c.setEpoch(5);
                            c.setJobDone(true);
                            c.setSnapshotStep(-1);
                            c.setForceStep(-1);
                          });
  s["follower_seal"] = Heartbeat(1, 5, 1, true) + Peer(1, 5, [](PeerMessage::Builder m) {
                         auto seal = m.initSeal();
                         seal.setStep(10);
                         auto parts = seal.initParts(1);
                         parts[0].setStep(10);
                         parts[0].setFile("part-0-of-3");
                       });
  // Messages a chief receives (shard 0 is chief only after its own tick; the seeds still reach
  // the term and role checks).
  s["prepared"] = Step(1, 1, 0, false) + Step(2, 1, 0, false);
  s["committed"] = Step(1, 1, 0, true) + Step(2, 1, 0, true);
  s["restored"] = Restored(1, 1) + Restored(2, 1);
  s["part_written"] = Part(1, 1, 10) + Part(2, 1, 10);
  s["checkpoint_request"] = Peer(2, 0, [](PeerMessage::Builder m) { m.setCheckpointRequest(); });
  s["stale_term"] = Heartbeat(2, 7, 2, true) + Restore(1, 3, -1);
  return s;
}

std::map<std::string, std::map<std::string, Bytes>> AllSeeds() {
  auto worker = WorkerSeeds();
  auto peer = PeerSeeds();
  std::map<std::string, Bytes> frame = worker;
  for (auto& [name, bytes] : peer) frame["peer_" + name] = bytes;
  // worker_request inputs start with the daemon's settings byte (worker_fuzz.cc): sync for every
  // seed, and the step sequence again under each other mode and option.
  std::map<std::string, Bytes> worker_request;
  for (auto& [name, bytes] : worker) worker_request[name] = Bytes(1, '\0') + bytes;
  const std::pair<const char*, char> variants[] = {
      {"async", 1}, {"ssp", 2}, {"soft_sync", 3}, {"sum_ema", 4 | 8}, {"two_replicas", 16}};
  for (auto& [variant, settings] : variants) {
    for (const char* seed : {"steps", "push_sparse", "reduce", "update", "wait_token"}) {
      worker_request[std::string(seed) + "_" + variant] = Bytes(1, settings) + worker[seed];
    }
  }
  return {{"frame", frame}, {"worker_request", worker_request}, {"peer_message", peer}};
}

bool ReadFile(const fs::path& p, Bytes* out) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return false;
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

int Check(const fs::path& dir) {
  int bad = 0;
  for (auto& [target, seeds] : AllSeeds()) {
    std::set<std::string> on_disk;
    if (fs::is_directory(dir / target)) {
      for (auto& e : fs::directory_iterator(dir / target)) on_disk.insert(e.path().filename().string());
    }
    for (auto& [name, bytes] : seeds) {
      Bytes have;
      if (!ReadFile(dir / target / name, &have) || have != bytes) {
        std::fprintf(stderr, "%s/%s/%s is missing or out of date\n", dir.c_str(), target.c_str(), name.c_str());
        ++bad;
      }
      on_disk.erase(name);
    }
    for (auto& extra : on_disk) {
      std::fprintf(stderr, "%s/%s/%s is not a seed psd_fuzz_corpus writes\n", dir.c_str(), target.c_str(),
                   extra.c_str());
      ++bad;
    }
  }
  if (bad) {
    std::fprintf(stderr, "the seed corpus does not match the schema: run psd_fuzz_corpus %s and commit it\n",
                 dir.c_str());
    return 1;
  }
  std::printf("seed corpus in %s is current\n", dir.c_str());
  return 0;
}

int Write(const fs::path& dir) {
  for (auto& [target, seeds] : AllSeeds()) {
    fs::path sub = dir / target;
    std::error_code ec;
    fs::remove_all(sub, ec);
    fs::create_directories(sub, ec);
    if (ec) {
      std::fprintf(stderr, "cannot create %s: %s\n", sub.c_str(), ec.message().c_str());
      return 1;
    }
    for (auto& [name, bytes] : seeds) {
      std::ofstream f(sub / name, std::ios::binary);
      f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      if (!f) {
        std::fprintf(stderr, "cannot write %s\n", (sub / name).c_str());
        return 1;
      }
    }
    std::printf("%zu seeds in %s\n", seeds.size(), sub.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--check") == 0) return Check(argv[2]);
  if (argc == 2 && argv[1][0] != '-') return Write(argv[1]);
  std::fprintf(stderr,
               "usage: psd_fuzz_corpus DIR   (writes DIR/<target>/*)\n"
               "       psd_fuzz_corpus --check DIR\n");
  return 2;
}
