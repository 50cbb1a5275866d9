#!/usr/bin/env bash
# e2e, multi-host: 3 psd shards, each in its own network namespace (its own IP, all on port 7070),
# joined by veth pairs to a router namespace where the workers run. Then:
#  - the cluster trains with workers on the "router host" (over TCP: shared memory is for workers
#    in a shard's own namespace, and is not attached from another);
#  - shard 2's link is cut (no FIN, no RST: only the heartbeat timeout can tell), the cluster
#    stops serving and says which shard is missing; the link comes back, the cluster restores its
#    newest checkpoint as one and the job finishes.
# Needs root and iproute2; exits 77 (skipped) with a message where network namespaces cannot be
# created.
set -euo pipefail
psd=$1 worker=$2 admin=$3
if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null; then
  echo "SKIP: needs root and iproute2 to create network namespaces"
  exit 77
fi
tag="psd$$"
router="$tag-r"
run=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 $(pgrep -P "$p") "$p" 2>/dev/null || true; done
  for k in 0 1 2; do ip netns del "$tag-$k" 2>/dev/null || true; done
  ip netns del "$router" 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT
source "$(dirname "$0")/cluster_lib.sh"
if ! ip netns add "$router" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here"
  exit 77
fi
ip -n "$router" link set lo up
ip netns exec "$router" sysctl -qw net.ipv4.ip_forward=1
for k in 0 1 2; do
  ns="$tag-$k"
  ip netns add "$ns"
  ip link add "$tag-h$k" type veth peer name "$tag-p$k"
  ip link set "$tag-h$k" netns "$ns"
  ip link set "$tag-p$k" netns "$router"
  ip -n "$ns" addr add "10.77.$k.2/24" dev "$tag-h$k"
  ip -n "$router" addr add "10.77.$k.1/24" dev "$tag-p$k"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$tag-h$k" up
  ip -n "$router" link set "$tag-p$k" up
  ip -n "$ns" route add default via "10.77.$k.1"
done
cluster="10.77.0.2:7070,10.77.1.2:7070,10.77.2.2:7070"
# Shards listen on 10.77.k.2, beyond loopback: protected mode needs a secret or --insecure.
flags=(--cluster "$cluster" --insecure -R 3 -B 1 --init-tokens 0 --learning-rate 0.5 --exit-when-done --slice-bytes 8192
  --checkpoint-every-steps 10 --summary-interval-s 0)
declare -A shard_pid
for k in 0 1 2; do
  # Each shard has its own host: its own namespace and checkpoint directory.
  ip netns exec "$tag-$k" timeout 240 "$psd" "${flags[@]}" --shard-index "$k" --checkpoint-dir "$run/ckpt$k" \
    2> "$run/s$k.log" &
  shard_pid[$k]=$!
  pids+=($!)
done
wp=()
for w in 0 1 2 3; do
  ip netns exec "$router" timeout 240 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps 600 \
    --features 4096 --slow-ms 2 --print-every 0 --retry-s 90 > "$run/w$w.log" 2>&1 &
  wp+=($!); pids+=($!)
done
wait_for "$run/s0.log" "checkpoint at step ([3-9]|[1-9][0-9])0 sealed" 120 || fail "no checkpoint sealed"
ip netns exec "$router" "$admin" --cluster "$cluster" placement > "$run/placement.txt" || fail "psd_admin placement"
grep -q "logreg/w .* shard [0-9] rows \[0, " "$run/placement.txt" || fail "logreg/w is not sliced: $(cat "$run/placement.txt")"
echo "placement across hosts:"; sed 's/^/  /' "$run/placement.txt"

# Partition shard 2: its link goes down without closing anything.
ip -n "$router" link set "$tag-p2" down
wait_for "$run/s0.log" "waiting for shard 2" 10 || fail "the chief did not notice the partition"
echo "partitioned shard 2: $(grep -h "cluster: waiting for shard 2\|stopped serving" "$run/s0.log" | head -1 | sed 's/.*cluster: //')"
ip netns exec "$router" "$admin" --cluster "$cluster" status > "$run/status.txt" 2>&1 || true
grep -q "missing: 2" "$run/status.txt" || fail "psd_admin status does not name the missing shard: $(cat "$run/status.txt")"
sleep 1
ip -n "$router" link set "$tag-p2" up
for p in "${wp[@]}"; do wait "$p" || fail "a worker failed"; done
for k in 0 1 2; do wait "${shard_pid[$k]}" || fail "shard $k did not exit 0"; done
grep -q "from checkpoint step" <<< "$(grep -h "running at epoch" "$run"/s*.log)" || fail "the cluster did not restore after the partition"
echo "after the partition: $(grep -h "running at epoch .* from checkpoint" "$run"/s*.log | tail -1 | sed 's/.*cluster: //')"
for w in 0 1 2 3; do
  final=$(sed -n 's/.*loss [0-9.]* -> \([0-9.]*\),.*/\1/p' "$run/w$w.log")
  awk -v f="$final" 'BEGIN { exit !(f != "" && f < 0.45) }' || fail "w$w: final loss '$final'"
done
echo "training finished across 3 namespaces: $(grep done: "$run/w0.log")"
# Workers on "another host" cannot reach a shard's shared-memory socket: they stayed on TCP.
! grep -q "shared memory attached" "$run"/s*.log || fail "a worker in another namespace attached shared memory"
echo "PASS"
