#!/usr/bin/env bash
# The live status page in headless Chromium: psd with --metrics-port trains the example model with
# three workers; the page (served by psd, nothing from outside) must load, show the job ready, list
# the workers, and show a global step that moves between two loads; a screenshot is taken.
#   status_page_test.sh PSD WORKER [SCREENSHOT_DIR]
set -euo pipefail
psd=$1 worker=$2 shots=${3:-}
run=$(mktemp -d)
pids=()
source "$(dirname "$0")/cluster_lib.sh"
source "$(dirname "$0")/chrome_lib.sh"
trap stop_all EXIT
need_chromium

timeout 120 "$psd" --port 0 --port-file "$run/port" --metrics-port 0 --metrics-port-file "$run/mport" \
  -R 2 -B 1 --init-tokens 0 --learning-rate 0.5 --exit-when-done 2> "$run/psd.log" &
pids+=($!)
for _ in $(seq 200); do [ -s "$run/port" ] && break; sleep 0.05; done
[ -s "$run/port" ] || fail "psd did not become ready"
port=$(cat "$run/port") mport=$(cat "$run/mport")
# Slow workers so the job is still running while the page is loaded twice (stopped at the end).
for i in 0 1 2; do
  timeout 120 "$worker" --port "$port" --worker-name "worker-$i" --shard "$i" --steps 100000 --slow-ms 10 \
    --print-every 100000 > "$run/worker-$i.log" 2>&1 &
  pids+=($!)
done

# The page polls /status.json every second; 3 s of virtual time let it render a few times.
step_of() { sed -n 's/.*id="global-step">\([0-9][0-9]*\)<.*/\1/p' | head -1; }
sleep 1
chrome 1 --virtual-time-budget=3000 --dump-dom "http://127.0.0.1:$mport/" > "$run/dom1.html" || fail "chromium failed: $(tail -5 "$run/chrome.log")"
sleep 2
chrome 2 --virtual-time-budget=3000 --dump-dom "http://127.0.0.1:$mport/" > "$run/dom2.html" || fail "chromium failed"
s1=$(step_of < "$run/dom1.html")
s2=$(step_of < "$run/dom2.html")
[ -n "$s1" ] && [ -n "$s2" ] || fail "the page shows no global step: $(head -c 600 "$run/dom1.html")"
grep -q 'data-updates="[1-9]' "$run/dom1.html" || fail "the page never rendered /status.json"
grep -q 'class="badge ok">ready<' "$run/dom2.html" || fail "the page does not show psd ready"
for i in 0 1 2; do
  grep -q "data-worker=\"worker-$i\"" "$run/dom2.html" || fail "worker-$i is not listed"
done
grep -q '<td>logreg/w</td>' "$run/dom2.html" || fail "the placement table does not list logreg/w"
[ "$s2" -gt "$s1" ] || fail "the global step did not move between two loads ($s1 then $s2)"
echo "status page: global step $s1 then $s2, 3 workers listed"

screenshot "http://127.0.0.1:$mport/" status_page.png "$shots"
echo "PASS: status page"
