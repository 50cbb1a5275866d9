# The psd wire protocol.
#
# Framing: every frame is one Cap'n Proto message in the standard stream format (segment table,
# then segments). A client sends Request frames, the daemon answers each with one Response frame
# carrying the same `id`. Responses can come back out of order (a token wait is parked while
# later requests are served), so a client that pipelines matches replies by id.
#
# Compatibility: `protocolVersion` in Hello is checked by the daemon; fields are only ever added
# at the end of a struct (Cap'n Proto's evolution rules), never renumbered.

@0xd42b10e820ca1ef4;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("psd::proto");

const protocolVersion :UInt32 = 1;

# What the caller should do with a failed reply.
enum Code {
  ok @0;
  invalidArgument @1;     # the request is wrong: fix it, do not retry
  notFound @2;            # unknown variable/slot
  alreadyExists @3;       # name exists with a different definition
  failedPrecondition @4;  # out of order (e.g. no Hello yet)
  deadlineExceeded @5;    # a wait ran past its deadline; nothing was lost, retry
  unavailable @6;         # shard/daemon not ready; back off and retry
  cancelled @7;           # the daemon is shutting down
  outOfRange @8;          # the token queue is closed: training is over
  resourceExhausted @9;   # frame too big, too many connections
  internal @10;           # a bug in psd
  unimplemented @11;      # not supported by this daemon
  unauthenticated @12;    # missing or wrong auth token: fix the credentials
  aborted @13;            # the cluster restored a checkpoint: re-read the step and values, go on
}

enum DType {
  float32 @0;
  float64 @1;
  bfloat16 @2;            # 16-bit patterns, little-endian
  float16 @3;             # IEEE 754 binary16
}

enum Reduction {
  mean @0;
  sum @1;
}

# How the assignments that replicas make to a variable combine (TF's VariableAggregation); for a
# sync-on-read variable, how a read combines the replicas' own values.
enum Aggregation {
  none @0;              # every replica must assign the same value (else INVALID_ARGUMENT)
  sum @1;
  mean @2;
  onlyFirstReplica @3;  # replica 0's assignment is taken, the others' ignored
}

enum UpdateOp {
  assign @0;
  assignAdd @1;
  assignSub @2;
  scale @3;             # value *= factor
}

struct Tensor {
  dtype @0 :DType;
  shape @1 :List(Int64);
  data @2 :Data;          # little-endian, row-major, exactly numel * sizeof(dtype) bytes
  inShm @3 :Bool;         # the bytes are not in `data` but in the connection's shared-memory
  shmOffset @4 :UInt64;   # segment (README "Same-host shared memory"), at this offset
  shmSegment @5 :UInt8;   # ... of this segment: 0 the connection's own, 1 the worker's shared
                          # buffers (psclient::Client::AllocateShared), 2 the daemon's values
                          # segment (read-only to workers; in pull replies only)
}

# Where in the connection's shared memory a reply's values are to be written, instead of in the
# reply: in segment 0, one after another from `offset` (each at a multiple of 64 bytes) within
# `bytes`; or, with `offsets` (one per value), each at its own offset of `segment` (the caller's
# shared buffers: the values land in place).
struct ShmTarget {
  offset @0 :UInt64;
  bytes @1 :UInt64;
  segment @2 :UInt8;
  offsets @3 :List(UInt64);
  values @4 :Bool;        # the worker maps the daemon's values segment: a value psd keeps there may
                          # be named in place (segment 2) instead of written into the room
}

struct Hello {
  protocolVersion @0 :UInt32;
  workerName @1 :Text;    # stable identity of the worker (e.g. "worker-3")
  incarnation @2 :UInt64; # bumps on every restart of that worker process
  authToken @3 :Text;     # the shared secret, when psd runs with --auth-token-file
  observer @4 :Bool;      # an operator's tool: not a worker (never chief, never counted)
  peer @5 :Bool;          # another psd shard of the cluster (then shardIndex and clusterSize)
  shardIndex @6 :UInt32;
  clusterSize @7 :UInt32;
  peerNonce @8 :Data;     # a peer, with --cluster-secret-file: the dialer's challenge (32 random bytes)
}

struct JobConfig {
  replicasToAggregate @0 :Int32;
  totalReplicas @1 :Int32;
  tokensPerStep @2 :Int32;
  initTokens @3 :Int32;
  optimizer @4 :Text;
  learningRate @5 :Float64;
  reduction @6 :Reduction;
  slotNames @7 :List(Text);
  mode @8 :Text;                 # sync, async, ssp
  stalenessBound @9 :Int64;      # ssp
  softSyncFraction @10 :Float64; # sync: 0 = off
  stepDeadlineMs @11 :Int64;     # sync: 0 = off
  emaDecay @12 :Float64;         # 0 = no moving averages
}

struct HelloReply {
  protocolVersion @0 :UInt32;
  isChief @1 :Bool;
  globalStep @2 :Int64;
  config @3 :JobConfig;
  workerId @4 :UInt32;    # daemon-assigned index of this worker (order of first hello)
  shardIndex @5 :UInt32;  # this daemon's index in its cluster (0 for a single daemon)
  shards @6 :UInt32;      # shards in the cluster (1 for a single daemon)
  chiefShard @7 :Int32;   # the elected chief shard (-1: none right now)
  clusterEpoch @8 :UInt64;  # bumps whenever the cluster restores a checkpoint as one (0: single daemon)
  maxFrameBytes @9 :UInt64;  # psd's --max-frame-bytes: clients refuse to send bigger requests (0: unknown)
  peerNonce @10 :Data;    # to a peer's hello, with --cluster-secret-file: the acceptor's challenge
  peerProof @11 :Data;    # ... and its proof (HMAC-SHA256, server/cluster/peer_auth.h)
  chunkElements @12 :UInt64;  # the part size gradient chunks align to (0: chunks not taken)
  shmSocket @13 :Text;    # a worker on this host may attach a shared-memory segment: the abstract
  shmNonce @14 :Data;     # Unix socket to pass it on, and this connection's one-time nonce (empty: no)
  connectionId @15 :UInt64;  # ... with which the segment is sent
  shmMaxBytes @16 :UInt64;   # ... and the biggest segment psd maps (--shm-max-bytes)
  maxQueuedReplyBytes @17 :UInt64;  # psd's --max-queued-reply-bytes: it reads no further request
                                    # while more reply bytes wait for this connection (0: unknown)
}

struct CreateVariable {
  name @0 :Text;
  initial @1 :Tensor;     # dtype + shape + initial value (data may be empty: zeros)
  trainable @2 :Bool = true;
  average @3 :Bool;       # keep an exponential moving average (psd --ema-decay)
  optimizer @4 :Text;     # empty: the job's optimizer
  placement @5 :VariablePlacement;  # cluster: the whole variable's placement; `initial` is part `part` of it
  part @6 :UInt32;
  aggregation @7 :Aggregation;
  syncOnRead @8 :Bool;    # each replica keeps its own value; a read combines them (aggregation sum or mean)
  # An initial value bigger than a frame comes in chunks, in order, on one connection: `initial` is
  # then a flat run of elements starting at element `chunkOffset` of a value of shape `chunkedShape`;
  # every chunk but the last has `more` set and is answered `none`; the variable is created (and
  # visible) only with the last chunk. Another request in between drops the chunks received.
  chunked @9 :Bool;
  chunkOffset @10 :Int64;
  chunkedShape @11 :List(Int64);
  more @12 :Bool;
}

# Where a variable lives in a cluster: one part (the whole variable) or slices along dimension 0.
struct SlicePart {
  shard @0 :UInt32;
  rowBegin @1 :Int64;
  rowEnd @2 :Int64;
}

struct VariablePlacement {
  name @0 :Text;
  dtype @1 :DType;
  shape @2 :List(Int64);    # the whole variable's shape
  sliced @3 :Bool;          # false: one part holding the whole variable
  parts @4 :List(SlicePart);
  trainable @5 :Bool = true;
}

struct Place {
  name @0 :Text;
  dtype @1 :DType;
  shape @2 :List(Int64);
  colocateWith @3 :Text;    # place on the same shard(s) as this existing variable
  trainable @4 :Bool = true;
}

struct PlacementMap {
  variables @0 :List(VariablePlacement);
  shardBytes @1 :List(UInt64);  # bytes of variable values placed on each shard
}

struct VariableInfo {
  name @0 :Text;
  dtype @1 :DType;
  shape @2 :List(Int64);
  created @3 :Bool;       # true if this call created it, false if it existed already
  trainable @4 :Bool;
}

struct ElementRange {
  offset @0 :Int64;       # the first element of the flattened tensor
  count @1 :Int64;        # > 0
  wholeShape @2 :List(Int64);  # a pull's: the shape the caller's view gives the whole value; a value
                               # of another shape is refused, as an unranged pull's view (empty: any)
}

struct Pull {
  names @0 :List(Text);
  averages @1 :Bool;      # the moving averages instead of the values
  dtypes @2 :List(DType); # empty, or one per name: deliver the values converted to it (round to nearest even)
  ranges @3 :List(ElementRange);  # empty, or one per name: only those elements, as a flat [count]
                                  # (a value bigger than a reply frame is read in several); names may repeat
  toShm @4 :ShmTarget;    # set: the values are written into the shared-memory segment there
}

struct PullRows {
  name @0 :Text;
  rows @1 :List(Int64);   # any order, repeats allowed
  hasDtype @2 :Bool;      # deliver the rows converted to `dtype` (else the variable's own)
  dtype @3 :DType;
  toShm @4 :ShmTarget;    # set: the rows are written into shared memory, not the reply: one after
                          # another from `offset` within `bytes` of segment 0; or in the shared
                          # buffers (segment 1) one after another from offsets[0], or, with one
                          # offset per row, each row at its own offset
}

struct PullReply {
  step @0 :Int64;         # every value in the reply reflects this global step
  values @1 :List(Tensor);
  clusterEpoch @2 :UInt64;
}

struct Gradient {
  name @0 :Text;
  grad @1 :Tensor;        # dense: the gradient; sparse: the values [nnz, row dims...]
  sparse @2 :Bool;        # IndexedSlices
  indices @3 :List(Int64);
  hasDenseShape @4 :Bool;
  denseShape @5 :List(Int64);
  chunk @6 :Bool;         # dense only: `grad` is a flat [n], the elements [chunkOffset, chunkOffset + n)
  chunkOffset @7 :Int64;  # of the variable's flattened gradient (a gradient bigger than a frame);
                          # aligned to HelloReply.chunkElements, n too unless it ends the tensor
  rowsMore @8 :Bool;      # sparse only: more rows of this gradient follow in a later frame of the
                          # same push (Push.more set here), their indices continuing to increase; a
                          # sparse gradient bigger than a frame counts once, with its last rows
}

struct Push {
  localStep @0 :Int64;
  grads @1 :List(Gradient);
  waitToken @2 :Bool;     # after the push, also wait for a token (one round trip per step)
  timeoutMs @3 :Int64;    # deadline for the token wait; <= 0 means the daemon's default
  pullAfter @4 :List(Text);  # after the token, also return these variables' values (one round trip per step)
  clusterEpoch @5 :UInt64;   # the epoch the gradients were computed in; another one is ABORTED (0: unchecked)
  pullAfterDtypes @6 :List(DType);  # empty, or one per pullAfter name, as Pull.dtypes
  more @7 :Bool;             # more frames of this push follow (no waitToken, no pullAfter): a push
                             # bigger than a frame is sent in several, the token wait on the last
  pullToShm @8 :ShmTarget;   # set: the pullAfter values go into the shared-memory segment, as Pull.toShm
}

struct GradResult {
  accepted @0 :Bool;      # false: stale (local step < accumulator step), dropped
  step @1 :Int64;         # the accumulator's step when the push was handled
  staleness @2 :Int64;    # global step - local step when it was handled
}

struct PushReply {
  results @0 :List(GradResult);   # one per pushed gradient, same order
  token @1 :Int64;                # the dequeued token (new local step), if waitToken
  tokenCode @2 :Code;             # outcome of the token wait, if waitToken
  tokenMessage @3 :Text;
  isChief @4 :Bool;
  stepGradients @5 :Int32;        # gradients averaged (fewest per variable) in the last committed step
  pulled @6 :PullReply;           # the pullAfter values, when the token wait succeeded
  clusterEpoch @7 :UInt64;
  chiefShard @8 :Int32;
}

struct WaitToken {
  timeoutMs @0 :Int64;
  # The local step of the push this wait follows (a cluster's chief that held no part of it): the
  # wait takes a token released after that step, or an initial one; -1: any token.
  afterStep @1 :Int64 = -1;
}

struct TokenReply {
  token @0 :Int64;
  isChief @1 :Bool;
  stepGradients @2 :Int32;
}

# reduce_to / batch_reduce_to: every replica contributes a value per destination and step; once
# the step's required replicas contributed, the sum (or mean) is assigned to the destination and
# every contributor gets it back.
struct ReduceEntry {
  destination @0 :Text;
  value @1 :Tensor;
}

struct Reduce {
  op @0 :Reduction;
  localStep @1 :Int64;    # staleness as for gradients: older than the destination's round is dropped
  replica @2 :UInt32;     # unused (ignored; not sent since 0.1): the daemon knows the sender from its hello
  entries @3 :List(ReduceEntry);
  timeoutMs @4 :Int64;    # <= 0: the daemon's token timeout
}

struct ReduceResult {
  accepted @0 :Bool;      # false: stale, dropped (value: the destination's current value)
  step @1 :Int64;         # the round it counted for
  value @2 :Tensor;       # the reduced value
}

struct ReduceReply {
  results @0 :List(ReduceResult);
}

# update(variable, fn): an update computed where the variable lives.
struct Update {
  variable @0 :Text;
  op @1 :UpdateOp;
  value @2 :Tensor;       # assign / assignAdd / assignSub (empty for scale)
  factor @3 :Float64;     # scale
  crossReplica @4 :Bool;  # one caller for all replicas (applied at once); else this replica's share
  replica @5 :UInt32;
  localStep @6 :Int64;
  timeoutMs @7 :Int64;
  atNextStep @8 :Bool;    # cross-replica, sync mode: published with the next step's commit
  # A value bigger than a frame comes in chunks, as CreateVariable's initial value does: `value` is
  # then a flat run of elements starting at element `chunkOffset` of a value of shape
  # `chunkedShape`; every chunk but the last has `more` set and is answered `none`; the update is
  # made (and counted) only with the last chunk. Another request in between drops the chunks.
  chunked @9 :Bool;
  chunkOffset @10 :Int64;
  chunkedShape @11 :List(Int64);
  more @12 :Bool;
}

struct UpdateReply {
  applied @0 :Bool;       # false: only-first-replica aggregation ignored this replica
  step @1 :Int64;         # the round (replica context) the assignment counted for
}

struct GetSlot {
  variable @0 :Text;
  slot @1 :Text;
  hasDtype @2 :Bool;      # deliver the slot converted to `dtype` (else the variable's own)
  dtype @3 :DType;
  range @4 :ElementRange; # with hasRange: only these elements, as a flat [count] (a slot bigger than a reply)
  hasRange @5 :Bool;
}

struct JobStatus {
  globalStep @0 :Int64;
  isChief @1 :Bool;
  tokensQueued @2 :Int64;
  workersConnected @3 :Int32;
  workersFinished @4 :Int32;
  replicasRequired @5 :Int32;     # replicas the current step waits for (shrinks as workers finish)
  acceptedPushes @6 :Int64;
  stalePushes @7 :Int64;
  config @8 :JobConfig;
  lastStepGradients @9 :Int32;
  maxStaleness @10 :Int64;
  learningRate @11 :Float64;
  lastCheckpointStep @12 :Int64;  # -1: none
  shardIndex @13 :UInt32;
  shards @14 :UInt32;
  chiefShard @15 :Int32;          # -1: no chief right now
  term @16 :UInt64;               # election term
  clusterEpoch @17 :UInt64;
  clusterState @18 :Text;         # "running", or what the cluster waits for
  missingShards @19 :List(UInt32);
  workers @20 :List(Text);        # workers' names in first-hello order (index = replica id)
  version @21 :Text;              # psd's version
  uptimeS @22 :Float64;           # seconds since this psd started
  ready @23 :Bool;                # restored, formed and serving workers (what /readyz says)
  shardAddresses @24 :List(Text); # cluster: where each shard serves now (a stand-in's address after a takeover)
}

# --- shard to shard (cluster) -----------------------------------------------------------------
# One-way messages over each shard's outgoing link to every other shard; never answered.
# `term` fences: a shard acts on a chief's message only if it carries its current term.

struct PeerHeartbeat {
  chief @0 :Int32;          # who the sender thinks is chief (-1: nobody)
  epoch @1 :UInt64;         # the epoch the sender's state belongs to
  running @2 :Bool;         # from the chief: the cluster serves workers at `epoch`
  step @3 :Int64;           # unused (no shard reads it; no longer written); kept for the ordinals
  sealedSteps @4 :List(Int64);  # checkpoints this shard can restore (manifest + own part verified)
  ready @5 :Bool;           # the sender has scanned its checkpoints
  required @6 :Int32;       # from the chief: fresh gradients a step needs
  allowStateLoss @7 :Bool;  # the sender runs with --allow-state-loss (README "Losing a shard's checkpoints")
  waiting @8 :Text;         # from the chief: why it does not form the cluster (""): an operator must decide
  unusableSteps @9 :List(Int64);  # checkpoint directories present here that this shard cannot restore
  ownCopies @10 :List(PeerCopy);  # replication: the sender's own committed states it keeps
  heldCopies @11 :List(PeerCopy); # replication: its predecessor's committed states it keeps
  listening @12 :Bool;      # the sender started less than an election timeout ago: it claims nothing yet
  address @13 :Text;        # where the sender serves (host:port): its --cluster entry, or a stand-in's
  standIn @14 :Bool;        # the sender is a stand-in for its shard, run by the next shard (takeover)
  moved @15 :List(PeerMoved);  # from the chief: shards served elsewhere than their --cluster entry
  released @16 :PeerCopy;   # the newest (epoch, step) whose tokens the sender knows went out to workers
  unsealedParts @17 :List(PeerPart);  # the sender's own part on disk of each step it lists as unusable
                            # (size, checksum; epoch unused): a seal sent with a restore order must match it
  keptCopies @18 :List(PeerCopy);  # async/ssp replicas: per shard (by index), the newest copy of its part the
                            # sender heard the next shard keeps (every acknowledged push is in it or older)
  servedParts @19 :List(PeerServed);  # async/ssp replicas: per shard (by index), the newest epoch the sender
                            # knows served workers with its part, and whether a stand-in served it then
  newestSeal @21 :PeerSeal;  # the manifest of the sender's newest sealed step (no parts: none), for a
                             # chief that holds its part of that step but missed the seal
  sealDigests @20 :List(UInt64);  # per step of sealedSteps (same order): a digest of the manifest the sender
                            # holds for it (0: not known; empty: not said): two timelines' manifests of one
                            # step differ, and such a step is restorable by no shard set that mixes them
}

# The newest epoch known to have served workers with a shard's part (0: none known).
struct PeerServed {
  epoch @0 :UInt64;
  standIn @1 :Bool;         # a stand-in served it: its newest copies are on the stand-in's host
}

# Takeover: shard `shard` is served at `address` (a stand-in), not at its --cluster entry.
struct PeerMoved {
  shard @0 :UInt32;
  address @1 :Text;
}

# Replication (--replicas-per-shard 2): a committed state of a shard's part.
struct PeerCopy {
  lineage @0 :UInt64;       # the epoch that started its timeline (from a checkpoint, or empty)
  step @1 :Int64;           # the global step it was committed at
}

# A piece of shard `owner`'s state `copy`, serialized: to the next shard after each commit, or
# back to the owner (`restore`) when a formation restores it there.
struct PeerReplicaChunk {
  epoch @0 :UInt64;
  owner @1 :UInt32;
  copy @2 :PeerCopy;
  restore @3 :Bool;
  offset @4 :UInt64;
  total @5 :UInt64;         # bytes of the whole copy (0 with `restore`: not held here)
  data @6 :Data;
  handBack @7 :Bool;        # to a shard's own process back from a stand-in: a copy of its
                            # predecessor's part that the stand-in kept (from the stand-in's host)
}

struct PeerCopyRef {
  epoch @0 :UInt64;
  copy @1 :PeerCopy;
  newest @2 :Bool;          # a fetch (async/ssp): the newest copy kept if newer than `copy` (the
                            # fetcher's own newest; lineage 0, step -1: none), else an empty answer
  sendWhole @3 :Bool;       # an ack: the copy came as a difference not usable here; send it whole
  handBack @4 :Bool;        # an ack of a copy handed back (PeerReplicaChunk.handBack)
}

struct PeerStep {
  epoch @0 :UInt64;
  step @1 :Int64;
  minGradients @2 :Int32;
  maxGradients @3 :Int32;
  takes @4 :Int32;          # variables taken (0: the shard has no trainable variable)
  forced @5 :Bool;
}

struct PeerCommit {
  epoch @0 :UInt64;
  step @1 :Int64;           # the step being closed: shards publish step + 1
  checkpoint @2 :Bool;      # snapshot this commit and write the part
  learningRate @3 :Float64; # the learning rate of the steps after this one
}

struct PeerRestore {
  epoch @0 :UInt64;
  step @1 :Int64;           # the checkpoint to restore; -1: start empty at step 0
  seal @2 :List(PeerPart);  # its manifest, for a shard that holds its part but missed the seal
                            # (written first, only if its part matches); empty: every shard has it
  live @3 :Bool;            # replication: restore the live copy (lineage, step), not a checkpoint
  lineage @4 :UInt64;
  newest @5 :Bool;          # with live (async/ssp): each shard restores the newest copy of its part
                            # (its own, or the next shard's if newer); no lineage, no common step
  moved @6 :List(PeerMoved);  # where the chief serves the shards it forms with, when elsewhere than
                              # their --cluster entry (a stand-in): followed before restoring
}

struct PeerRestored {
  epoch @0 :UInt64;
  step @1 :Int64;
  ok @2 :Bool;
  message @3 :Text;
  placements @4 :List(VariablePlacement);  # the parts this shard holds, as placed
}

struct PeerPart {
  epoch @0 :UInt64;
  step @1 :Int64;
  shard @2 :UInt32;
  file @3 :Text;
  bytes @4 :UInt64;
  checksum @5 :UInt64;
}

struct PeerSeal {
  step @0 :Int64;
  parts @1 :List(PeerPart);
}

struct PeerControl {
  epoch @0 :UInt64;
  jobDone @1 :Bool;         # every worker finished: write the final part (if checkpointing), then exit if asked
  snapshotStep @2 :Int64;   # the step of a checkpoint to write (-1: none): with jobDone the final one;
                            # without it (async/ssp) this shard's part, snapshotted now
  forceStep @3 :Int64;      # without jobDone (sync): force this step, the step deadline passed on some
                            # shard (-1: none; always set, its default 0 would force step 0)
}

struct PeerMessage {
  from @0 :UInt32;
  term @1 :UInt64;
  union {
    heartbeat @2 :PeerHeartbeat;
    prepared @3 :PeerStep;
    commit @4 :PeerCommit;
    committed @5 :PeerStep;
    restore @6 :PeerRestore;
    restored @7 :PeerRestored;
    partWritten @8 :PeerPart;
    seal @9 :PeerSeal;
    control @10 :PeerControl;
    checkpointRequest @11 :Void;
    replicaChunk @12 :PeerReplicaChunk;
    replicaAck @13 :PeerCopyRef;    # to the owner: its copy is kept whole
    replicaFetch @14 :PeerCopyRef;  # to the next shard: send my copy back
  }
  # The sending process (0: not said): a stand-in and its shard's own process share an index.
  sender @15 :UInt64;
  # To the chief, about an epoch: the process that ordered its restore (0: any).
  to @16 :UInt64;
}

struct Request {
  id @0 :UInt64;
  union {
    hello @1 :Hello;
    createVariable @2 :CreateVariable;
    pull @3 :Pull;
    push @4 :Push;
    waitToken @5 :WaitToken;
    status @6 :Void;
    finish @7 :Void;
    getSlot @8 :GetSlot;
    pullRows @9 :PullRows;
    setLearningRate @10 :Float64; # chief only; from the next step
    checkpoint @11 :Void;         # schedule a checkpoint at the next step boundary
    place @12 :Place;             # cluster, chief only: place (or find) a variable
    getPlacement @13 :Void;       # cluster, chief only: the whole placement map
    peer @14 :PeerMessage;        # shard to shard; never answered
    reduce @15 :Reduce;
    update @16 :Update;
    recover @17 :Recover;         # cluster, chief only: an operator's decision to lose checkpointed state
    peerProof @18 :Data;          # a peer's answer to the acceptor's challenge (before any peer message)
    valuesAck @20 :Void;          # only says valuesRead, as soon as the values are read; never answered
    useLane @21 :Void;            # the last frame on TCP: every later one, both ways, travels in the
                                  # shared-memory lane the attach made (wire/shm_lane.h); never answered
  }
  # The worker has read the values of every reply up to this request id that named the daemon's
  # values segment (Tensor.shmSegment 2): psd lets go of the buffers it held for them.
  valuesRead @19 :UInt64;
}

# An operator's answer to a chief that refuses to form because some shard's newest checkpoint is
# newer than what every shard can restore (README "Losing a shard's checkpoints").
struct Recover {
  step @0 :Int64;           # restore this checkpoint step on every shard; < 0: the newest every shard has
  empty @1 :Bool;           # start empty at step 0 instead (step ignored)
}

struct Response {
  id @0 :UInt64;
  code @1 :Code;
  message @2 :Text;
  union {
    none @3 :Void;
    hello @4 :HelloReply;
    variable @5 :VariableInfo;
    pull @6 :PullReply;
    push @7 :PushReply;
    token @8 :TokenReply;
    status @9 :JobStatus;
    slot @10 :Tensor;
    placement @11 :VariablePlacement;
    placementMap @12 :PlacementMap;
    reduce @13 :ReduceReply;
    update @14 :UpdateReply;
  }
}
