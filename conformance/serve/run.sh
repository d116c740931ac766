#!/usr/bin/env bash
# tether serve conformance: the crash-safety script (for the OpenAI-compatible local loop, for a
# Managed Agents agent against the testkit fake, and for the ACP SDK's example agent), the browser
# test (Debian chromium driven by
# playwright-core: the UI opened at the URL tether serve prints, its token taken from there), the
# cross-origin test (pages of another origin and a DNS-rebinding page, in chromium, refused), plus
# a check that the committed UI assets are what `npm ci && npm run build` produces. Installs what
# it needs; prints `N passed, N failed` last; non-zero on any failure.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
passed=0
failed=0
step() { # name, command...
  local name="$1"; shift
  local out
  out="$("$@" 2>&1)"; local rc=$?
  echo "$out" | sed "s/^/  [$name] /"
  # A step killed before it wrote anything (its whole process group, say) leaves only this.
  [[ -z "$out" ]] && echo "  [$name] no output; exit status $rc (over 128: killed by signal $((rc - 128)))"
  local p f
  p=$(echo "$out" | grep -Eo '^[0-9]+ passed, [0-9]+ failed' | tail -1 | cut -d' ' -f1)
  f=$(echo "$out" | grep -Eo '^[0-9]+ passed, [0-9]+ failed' | tail -1 | cut -d' ' -f3)
  if [[ -n "$p" ]]; then
    passed=$((passed + p)); failed=$((failed + f))
    [[ $rc -ne 0 && "$f" == 0 ]] && failed=$((failed + 1))
  elif [[ $rc -eq 0 ]]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
  fi
}

if [[ ! -x /usr/bin/chromium ]]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "could not install chromium"
fi
cargo build -q -p tether-serve --bin tether-serve --example fake_openai --example fake_managed || { echo "0 passed, 1 failed"; exit 1; }
(cd "$here" && npm ci --no-audit --no-fund --silent) || { echo "0 passed, 1 failed"; exit 1; }

ui_reproducible() {
  local tmp; tmp="$(mktemp -d)"
  cp "$root"/crates/tether-serve/assets/* "$tmp"/
  (cd "$root/web" && npm ci --no-audit --no-fund --silent && npm run -s build >/dev/null) || return 1
  for f in index.html app.js app.css; do
    cmp -s "$tmp/$f" "$root/crates/tether-serve/assets/$f" || { echo "assets/$f differs from a fresh build (the committed copy: $tmp)"; return 1; }
  done
  rm -rf "$tmp"
  echo "the committed UI assets match npm ci && npm run build"
}

step crash timeout 600 node "$here/crash.mjs"
step crash-managed env CRASH_PROVIDER=managed timeout 600 node "$here/crash.mjs"
[[ -f "$root/conformance/acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js" ]] ||
  bash "$root/conformance/acp/setup.sh" >/dev/null || echo "conformance/acp/setup.sh failed"
step crash-acp env CRASH_PROVIDER=acp timeout 600 node "$here/crash.mjs"
step browser timeout 600 node "$here/browser.mjs"
step browser-acp timeout 600 node "$here/browser_acp.mjs"
step browser-elicit timeout 600 node "$here/browser_elicit.mjs"
step cross-origin timeout 600 node "$here/cross_origin.mjs"
step ui-build ui_reproducible
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
