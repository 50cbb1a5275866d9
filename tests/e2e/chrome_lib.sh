# Headless Chromium for the status page tests (sourced after cluster_lib.sh; $run is set).

# Sets $chromium, or skips the test (exit 77) when Debian's chromium is not installed.
need_chromium() {
  chromium=$(command -v chromium || true)
  if [ -z "$chromium" ]; then
    echo "SKIP: Debian's chromium is not installed (deploy/install_deps.sh installs it)"
    exit 77
  fi
}
# chrome PROFILE ARGS...: one headless run with a fresh profile ($run/chrome-PROFILE); its messages
# go to $run/chrome.log.
chrome() {
  local profile=$1
  shift
  timeout 60 "$chromium" --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$run/chrome-$profile" "$@" 2>> "$run/chrome.log"
}
# screenshot URL NAME [DIR]: the page after 3 s of virtual time, 1280x1150, as $run/NAME (checked
# not to be blank-small), copied into DIR when given.
screenshot() {
  local url=$1 name=$2 dir=${3:-} size
  chrome "shot-$name" --virtual-time-budget=3000 --window-size=1280,1150 --screenshot="$run/$name" "$url" \
    > /dev/null || fail "no screenshot"
  size=$(stat -c %s "$run/$name")
  [ "$size" -gt 20000 ] || fail "the screenshot is suspiciously small ($size bytes)"
  if [ -n "$dir" ]; then
    mkdir -p "$dir"
    cp "$run/$name" "$dir/$name"
    echo "screenshot: $dir/$name ($size bytes)"
  fi
}
