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
}

enum DType {
  float32 @0;
  float64 @1;
}

enum Reduction {
  mean @0;
  sum @1;
}

struct Tensor {
  dtype @0 :DType;
  shape @1 :List(Int64);
  data @2 :Data;          # little-endian, row-major, exactly numel * sizeof(dtype) bytes
}

struct Hello {
  protocolVersion @0 :UInt32;
  workerName @1 :Text;    # stable identity of the worker (e.g. "worker-3")
  incarnation @2 :UInt64; # bumps on every restart of that worker process
  authToken @3 :Text;     # the shared secret, when psd runs with --auth-token-file
  observer @4 :Bool;      # an operator's tool: not a worker (never chief, never counted)
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
}

struct CreateVariable {
  name @0 :Text;
  initial @1 :Tensor;     # dtype + shape + initial value (data may be empty: zeros)
  trainable @2 :Bool = true;
  average @3 :Bool;       # keep an exponential moving average (psd --ema-decay)
  optimizer @4 :Text;     # empty: the job's optimizer
}

struct VariableInfo {
  name @0 :Text;
  dtype @1 :DType;
  shape @2 :List(Int64);
  created @3 :Bool;       # true if this call created it, false if it existed already
  trainable @4 :Bool;
}

struct Pull {
  names @0 :List(Text);
  averages @1 :Bool;      # the moving averages instead of the values
}

struct PullRows {
  name @0 :Text;
  rows @1 :List(Int64);   # any order, repeats allowed
}

struct PullReply {
  step @0 :Int64;         # every value in the reply reflects this global step
  values @1 :List(Tensor);
}

struct Gradient {
  name @0 :Text;
  grad @1 :Tensor;        # dense: the gradient; sparse: the values [nnz, row dims...]
  sparse @2 :Bool;        # IndexedSlices
  indices @3 :List(Int64);
  hasDenseShape @4 :Bool;
  denseShape @5 :List(Int64);
}

struct Push {
  localStep @0 :Int64;
  grads @1 :List(Gradient);
  waitToken @2 :Bool;     # after the push, also wait for a token (one round trip per step)
  timeoutMs @3 :Int64;    # deadline for the token wait; <= 0 means the daemon's default
  pullAfter @4 :List(Text);  # after the token, also return these variables' values (one round trip per step)
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
}

struct WaitToken {
  timeoutMs @0 :Int64;
}

struct TokenReply {
  token @0 :Int64;
  isChief @1 :Bool;
  stepGradients @2 :Int32;
}

struct GetSlot {
  variable @0 :Text;
  slot @1 :Text;
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
  }
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
  }
}
