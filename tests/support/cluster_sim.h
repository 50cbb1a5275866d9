// A deterministic fault simulation of a psd cluster's protocol (cluster/coordinator.h): P real
// ClusterCoordinators over an in-memory PeerNetwork, each with a fake ShardHost, driven by one
// seeded PRNG and a simulated clock (README "Running a cluster").
//
// The network behaves like psd's peer links (one TCP connection per direction): messages on a
// link arrive in order after a random delay (sometimes a long one), a link can break (the message
// and those in flight are lost, the receiver sees OnPeerDown, the link reconnects later), a
// message may be delivered twice, shards are partitioned from each other, and shards crash and
// restart with their "disk" (checkpoint parts and manifests) intact and everything else lost.
// With takeover, a shard may start a stand-in for its predecessor: one more coordinator speaking
// as that shard, at an address of its own, in the host's process (a crash of the host kills it,
// a lost disk takes its directory); links follow PeerNetwork::Retarget as the daemon's do.
// The fake engine publishes a hash chain of the steps it commits, so shards that committed the
// same steps hold the same value; the sim decides when a shard has prepared a step (workers'
// gradients arrive only for a step whose tokens were released).
//
// Invariants, checked as the events happen:
//  - one chief runs each epoch (epoch = the chief's term at formation): at most one shard forms
//    and serves a term;
//  - a step's tokens are released at most once per epoch, in order, and only once every shard
//    published that step with the same value;
//  - a formation starts only when every shard restored the same checkpoint (same step, value);
//  - no formation restores to before a checkpoint that every shard holds sealed on disk, unless
//    an operator approved it: the sim plays the operator, who answers a chief that refuses to
//    form (a shard lost its checkpoints) with `psd_admin recover` (ClusterCoordinator::Recover);
//  - once the faults stop (every shard up, no partition), the job finishes (every shard exits)
//    within bounded simulated time.
// Async (SimOptions::async) replaces the step commit with pushes applied on arrival; see there.
// A violation ends the run with the reason; RunSimulation with trace = true (same seed) records
// every event, for the failure report and replay.
#ifndef PSD_TESTS_SUPPORT_CLUSTER_SIM_H_
#define PSD_TESTS_SUPPORT_CLUSTER_SIM_H_

#include <cstdint>
#include <string>
#include <vector>

namespace psd::sim {

struct SimOptions {
  int shards = 3;
  uint64_t seed = 1;
  int64_t fault_ms = 6000;    // faults are injected in [0, fault_ms) of simulated time
  int64_t settle_ms = 30000;  // then every shard must have exited within this
  int64_t target_step = 24;   // the workers finish once the tokens of this step are released
  int64_t checkpoint_every = 4;
  // Faults per simulated second while they are on (crash, partition, broken link).
  double crash_rate = 0.4;
  double partition_rate = 0.3;
  double break_rate = 0.6;
  double lose_disk = 0.15;     // of the crashes: the shard's checkpoint directory is lost too
  int64_t max_down_ms = 3000;  // a crashed shard restarts after 100 ms to this (or once the faults stop)
  // Per message while faults are on.
  double break_on_send = 0.01;  // the link breaks at this message
  double duplicate = 0.02;      // delivered twice
  double slow = 0.03;           // a long delay (up to 1.5 s)
  bool trace = false;           // record every event (slower)
  // Replication (--replicas-per-shard 2): each shard's committed state also kept by the next one.
  // Invariants added: a copy kept is bit-identical to what its owner published at that step.
  bool replicate = false;
  // Crashes only while the cluster runs, one at a time (the next one at least 1.5 s after the
  // cluster serves again), no lost disks: with `replicate`, no formation may then go back before
  // a step whose tokens were released (a rollback).
  bool single_faults = false;
  // Takeover (with `replicate`; --takeover-after-ms): a shard gone this long is served by a
  // stand-in that the next shard runs (in its process: it dies with it), from the copy kept there,
  // until its own process is back. Invariants added: one process serves each part in an epoch
  // (the shard's own or its stand-in, never both), and a stand-in keeps its checkpoints in a
  // directory of its host's (lost with it). A checkpoint of a step whose tokens never went out
  // may then be given up by a formation through a stand-in (whose directory lacks it): that step
  // is computed again, nothing released is lost.
  bool takeover = false;
  int64_t takeover_after_ms = 1000;
  // Async (--mode async; with `replicate`): no step commit. Workers' pushes go to every shard that
  // serves, which applies each on arrival (its count is its step; the chief's count is the global
  // step, and the workers finish at target_step) and acknowledges it once a copy of its part
  // taken after it is kept by the next shard (ClusterCoordinator::AfterReplicated). Formations
  // restore each part's newest copy. Invariant added: with `single_faults`, every formation
  // restores every push a shard acknowledged for its part (a shard's state is the chain of the
  // pushes it applied, so the sim knows which a restored state holds).
  bool async = false;
  // > 0: each piece of a copy holds its link up to this long (half to all of it), so what is sent
  // behind it — heartbeats included — waits, as behind a copy of hundreds of MiB on a real link.
  int64_t copy_ms = 0;
  // The daemon's lane (ClusterCoordinator's `lane`): > 0, each batch of a shard's actions (a commit
  // applied and copied, a copy rebuilt, replies sent) runs after it was decided, in the order
  // decided — one in thirty up to this long after (a big commit or copy), the others within 3 ms
  // of the one before — while the shard's heartbeats and the messages it hears go on; a crash
  // drops the batches not yet run. 0: each batch runs as it is decided (the coordinator's default).
  int64_t lane_ms = 0;
};

struct SimResult {
  bool ok = true;
  std::string failure;              // the violated invariant, with the cluster's state
  std::vector<std::string> faults;  // the injected faults, in order (always recorded)
  std::vector<std::string> trace;   // with options.trace: every event
  int64_t events = 0;
  int64_t commits = 0;          // steps released to workers, all epochs
  int64_t formations = 0;       // epochs that served
  int64_t reseals = 0;          // seals a shard wrote from a restore order (it had missed the seal)
  int64_t contested = 0;        // formations of a term another shard formed too (settled before serving)
  int64_t live_formations = 0;  // formations from live copies (replicate)
  int64_t rollbacks = 0;        // formations before the newest step released to workers
  int64_t copies_checked = 0;   // copies compared with what their owner published (replicate)
  int64_t deltas = 0;           // copies taken as a difference from one kept (replicate)
  int64_t deltas_refused = 0;   // differences from a copy the receiver did not keep (sent again whole)
  int64_t stand_ins = 0;        // stand-ins started (takeover)
  int64_t stand_in_serves = 0;  // formations that served with a part on a stand-in (takeover)
  int64_t end_ms = 0;           // simulated time when the last shard exited
  int64_t pushes_acked = 0;     // async: a part's pushes acknowledged (once the next shard kept them)
  int64_t acked_lost = 0;       // async, several faults at a time: acknowledged pushes a formation lost
};

SimResult RunSimulation(const SimOptions& options);

// The options, the faults and the trace as text (what a failing test prints).
std::string Describe(const SimOptions& options, const SimResult& result, size_t max_trace_lines = 600);

}  // namespace psd::sim

#endif  // PSD_TESTS_SUPPORT_CLUSTER_SIM_H_
