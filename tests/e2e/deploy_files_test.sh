#!/usr/bin/env bash
# e2e.deploy_files: the deploy files are checked as far as this machine allows.
#   deploy_files_test.sh PSD PSD_ADMIN PSD_LOGREG_WORKER
# - Kubernetes (deploy/kubernetes/*.yaml): YAML parses (python3-yaml; yamllint when installed),
#   the structure psd needs (tests/e2e/deploy_files_check.py: headless Service, ordinal = shard
#   index, one cluster entry per replica, probes on the metrics port psd is given, no
#   --exit-when-done, the token Secret mounted and passed, the ConfigMap a valid psd config, the
#   worker Job's environment contract), and the API schemas when the npm validator is installed
#   (kubernetes-models, offline; see PSD_DEPLOY_LINT_DIR below).
# - Dockerfile: stages, COPY sources, .dockerignore, non-root user, volume, ports, and the runtime
#   packages against `ldd` of the built binaries (dockerfilelint too when installed). No image is
#   built: that needs a docker engine.
# - deploy/psd.conf and the ConfigMap's psd.conf: psd starts with them.
# - systemd: `systemd-analyze verify` of the unit (skipped without systemd-analyze).
# - Slurm: `bash -n`, shellcheck when installed, and a run of the script under a fake srun/scontrol
#   (2 shards on 127.0.0.1 and 127.0.0.2, 3 workers), then a resubmission that resumes.
# Optional linters (npm, not Debian):
#   npm install --prefix "${PSD_DEPLOY_LINT_DIR:-$HOME/.cache/psd-deploy-lint}" kubernetes-models@5.1.0 dockerfilelint@1.8.0
set -euo pipefail
psd=$(realpath "$1") admin=$(realpath "$2") worker=$(realpath "$3")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=/usr/bin/python3
lint_dir=${PSD_DEPLOY_LINT_DIR:-$HOME/.cache/psd-deploy-lint}/node_modules
run=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  rm -rf "$run"
}
trap cleanup EXIT
# shellcheck source-path=SCRIPTDIR
. "$here/cluster_lib.sh"  # fail (with the tails of $run/*.log), wait_for
not_checked=()

# --- Kubernetes --------------------------------------------------------------------------------
$py -c 'import yaml' 2>/dev/null || fail "python3-yaml is missing (deploy/install_deps.sh installs it)"
if command -v yamllint >/dev/null; then
  yamllint -s -d '{extends: default, rules: {line-length: {max: 200}, document-start: disable,
    comments: {min-spaces-from-content: 1}, braces: {max-spaces-inside: 1}}}' "$repo/deploy/kubernetes" ||
    fail "yamllint deploy/kubernetes"
  echo "yamllint deploy/kubernetes: ok"
else
  not_checked+=("yamllint (apt-get install yamllint)")
fi
"$psd" --help >"$run/psd-help.txt"
"$worker" --help >"$run/worker-help.txt"
$py "$here/deploy_files_check.py" k8s "$repo" "$run/psd-help.txt" "$run/worker-help.txt" || fail "deploy/kubernetes"
if command -v node >/dev/null && [ -d "$lint_dir/kubernetes-models" ]; then
  $py "$here/deploy_files_check.py" k8s-json "$repo" "$run/k8s.json" >/dev/null
  node "$here/deploy_schema_check.mjs" "$lint_dir" "$run/k8s.json" || fail "Kubernetes schema validation"
else
  not_checked+=("Kubernetes API schemas (npm kubernetes-models in $lint_dir)")
fi

# --- Dockerfile --------------------------------------------------------------------------------
binaries=("$psd" "$admin" "$worker")
[ -x "$(dirname "$admin")/psrun" ] && binaries+=("$(dirname "$admin")/psrun")
$py "$here/deploy_files_check.py" docker "$repo" "${binaries[@]}" || fail "deploy/docker/Dockerfile"
if command -v node >/dev/null && [ -x "$lint_dir/.bin/dockerfilelint" ]; then
  node "$lint_dir/.bin/dockerfilelint" -o json "$repo/deploy/docker/Dockerfile" >"$run/dfl.json" || true
  issues=$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["totalIssues"])' "$run/dfl.json")
  [ "$issues" = 0 ] || {
    node "$lint_dir/.bin/dockerfilelint" "$repo/deploy/docker/Dockerfile"
    fail "dockerfilelint: $issues issue(s)"
  }
  echo "dockerfilelint: ok"
else
  not_checked+=("dockerfilelint (npm)")
fi
not_checked+=("docker build (no docker engine in the test)")

# --- psd accepts the configs -------------------------------------------------------------------
config_starts() {  # $1: config file. psd must start with it and stop cleanly on SIGTERM.
  local pf dir
  dir=$(mktemp -d "$run/conf.XXXX")
  pf=$dir/port
  timeout 60 "$psd" --config "$1" --host 127.0.0.1 --port 0 --port-file "$pf" \
    --checkpoint-dir "$dir/ckpt" >"$dir/log" 2>&1 &
  local p=$!
  pids+=("$p")
  for _ in $(seq 200); do
    [ -s "$pf" ] && break
    kill -0 "$p" 2>/dev/null || break
    sleep 0.1
  done
  if ! { [ -s "$pf" ] && kill -TERM "$p" 2>/dev/null; }; then
    cat "$dir/log" >&2
    fail "psd does not start with $2"
  fi
  wait "$p" || {
    cat "$dir/log" >&2
    fail "psd started with $2 did not stop cleanly"
  }
  echo "psd starts with $2: ok"
}
config_starts "$repo/deploy/psd.conf" deploy/psd.conf
$py -c '
import sys, yaml
for d in yaml.safe_load_all(open(sys.argv[1])):
    if d and d["kind"] == "ConfigMap":
        open(sys.argv[2], "w").write(d["data"]["psd.conf"])' "$repo/deploy/kubernetes/psd.yaml" "$run/cm.conf"
config_starts "$run/cm.conf" "the ConfigMap psd-config"

# --- systemd -----------------------------------------------------------------------------------
unit=$repo/deploy/systemd/psd.service
for want in '^Type=notify$' '^NotifyAccess=main$' '^LoadCredential=token:' '^Restart=on-failure$' \
  '--auth-token-file %d/token' '^TimeoutStartSec=' '^TimeoutStopSec='; do
  grep -qe "$want" "$unit" || fail "psd.service: expected a line matching '$want'"
done
if command -v systemd-analyze >/dev/null; then
  # verify wants the ExecStart binary to exist: point it at the one built here.
  sed "s#^ExecStart=/usr/local/bin/psd#ExecStart=$psd#" "$unit" >"$run/psd.service"
  out=$(systemd-analyze verify "$run/psd.service" 2>&1) || fail "systemd-analyze verify: $out"
  [ -z "$out" ] || fail "systemd-analyze verify psd.service: $out"
  echo "systemd-analyze verify psd.service: ok"
else
  not_checked+=("systemd-analyze verify (needs systemd)")
fi

# --- Slurm -------------------------------------------------------------------------------------
job=$repo/deploy/slurm/psd_job.sh
bash -n "$job" || fail "psd_job.sh does not parse"
if command -v shellcheck >/dev/null; then
  shellcheck "$job" || fail "shellcheck psd_job.sh"
  echo "shellcheck psd_job.sh: ok"
fi
# shellcheck disable=SC2016  # a literal $workers
grep -E '^srun .*--overlap' "$job" | grep -q -- '--ntasks="\$workers"' || fail "psd_job.sh: the worker step needs --overlap"
grep -q 'SLURM_JOB_ID' "$job" && fail "psd_job.sh: nothing may be keyed by the job id (a resubmission must resume)"
# A fake Slurm: scontrol lists $FAKE_NODES; srun starts --ntasks copies with SLURM_PROCID and, for
# a step given --nodelist (the shards), SLURMD_NODENAME and a socket listening on that node's
# $PSD_PORT (LISTEN_FDS); it forwards SIGTERM to them.
mkdir -p "$run/bin"
cat >"$run/bin/scontrol" <<'EOF'
#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf '%s\n' $FAKE_NODES
EOF
cat >"$run/bin/srun" <<'EOF'
#!/usr/bin/env bash
n=1 nodelist=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) n=${1#*=} ;;
    --nodelist=*) nodelist=${1#*=} ;;
    --*) ;;
    *) break ;;
  esac
  shift
done
IFS=, read -ra nodes <<<"$nodelist"
pids=()
for ((i = 0; i < n; i++)); do
  if [ -n "$nodelist" ]; then  # the shard step: its socket on the node's reserved $PSD_PORT
    SLURM_PROCID=$i SLURMD_NODENAME=${nodes[i]} /usr/bin/python3 "$FAKE_LISTEN_PY" serve --host "${nodes[i]}" \
      --systemd "$PSD_PORT" -- "$@" &
  else
    SLURM_PROCID=$i SLURMD_NODENAME=${nodes[i]:-127.0.0.1} "$@" &
  fi
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for p in "${pids[@]}"; do
  while :; do
    wait "$p"
    r=$?
    kill -0 "$p" 2>/dev/null || break
  done
  [ "$r" -eq 0 ] || status=$r
done
exit "$status"
EOF
chmod +x "$run/bin/scontrol" "$run/bin/srun"
# The shards' port, the same on both fake nodes, is the test's own (tests/e2e/listen.py): the fake
# srun hands each shard a socket listening on it, as systemd's socket activation does (LISTEN_FDS).
$py "$listen_py" reserve-shared 127.0.0.1,127.0.0.2 "$run/shard.port" &
pids+=($!)
wait_for "$run/shard.port" . 10 || fail "could not reserve a port on 127.0.0.1 and 127.0.0.2"
port=$(cat "$run/shard.port")
slurm_env=(PATH="$run/bin:$PATH" FAKE_NODES="127.0.0.1 127.0.0.2" SLURM_JOB_NODELIST=fake SLURM_NTASKS=3
  SLURM_JOB_NAME=deploy-test PSD_BUILD="$(dirname "$(dirname "$psd")")" PSD_PORT="$port" PSD_METRICS_PORT=""
  FAKE_LISTEN_PY="$listen_py")
slurm_run() {  # $1: log name
  env -C "$run" "${slurm_env[@]}" PSD_STEPS=60 timeout 180 bash "$job" >"$run/$1.log" 2>&1 ||
    fail "psd_job.sh under a fake Slurm ($1) did not exit 0"
}
slurm_run slurm1
ckpt=$run/psd-checkpoints/deploy-test
ls -d "$ckpt"/shard-0/ckpt-* "$ckpt"/shard-1/ckpt-* >/dev/null 2>&1 ||
  fail "psd_job.sh: no checkpoint of both shards under psd-checkpoints/<job name>/shard-K"
[ "$(stat -c %a "$ckpt/token")" = 600 ] || fail "psd_job.sh: the token must be readable by the user only"
[ "$(stat -c %a "$ckpt/cluster-secret")" = 600 ] || fail "psd_job.sh: the cluster secret must be readable by the user only"
echo "psd_job.sh (fake Slurm, 2 shards, 3 workers): ok, $(grep -c 'done:' "$run/slurm1.log") workers done"
slurm_run slurm2
grep -qE "restoring checkpoint step [1-9]" "$run/slurm2.log" || {
  tail -30 "$run/slurm2.log" >&2
  fail "psd_job.sh resubmitted under the same job name did not restore its checkpoint"
}
echo "psd_job.sh resubmitted: resumed ($(grep -oE "restoring checkpoint step [0-9]+" "$run/slurm2.log" | head -1))"
# Near the time limit Slurm sends the script SIGUSR1 (--signal=B:USR1@300): the cluster checkpoints;
# then SIGTERM (scancel, the limit) stops everything.
env -C "$run" "${slurm_env[@]}" PSD_STEPS=100000000 bash "$job" >"$run/slurm3.log" 2>&1 &
job_pid=$!
pids+=("$job_pid")
wait_for "$run/slurm3.log" "global step +[0-9]*[1-9]" 60 || fail "psd_job.sh: the long job did not train"
kill -USR1 "$job_pid"
wait_for "$run/slurm3.log" "checkpoint at step [0-9]+ sealed" 60 || fail "psd_job.sh: SIGUSR1 did not checkpoint"
kill -TERM "$job_pid"
for _ in $(seq 600); do
  kill -0 "$job_pid" 2>/dev/null || break
  sleep 0.1
done
kill -0 "$job_pid" 2>/dev/null && fail "psd_job.sh did not stop within 60 s of SIGTERM"
echo "psd_job.sh: SIGUSR1 -> $(grep -oE "checkpoint at step [0-9]+ sealed" "$run/slurm3.log" | tail -1), SIGTERM -> stopped"

for n in "${not_checked[@]}"; do echo "not checked here: $n"; done
echo "deploy files: ok"
