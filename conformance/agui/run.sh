#!/usr/bin/env bash
# AG-UI conformance of tether-agui against the official client (@ag-ui/client@1.0.0).
# Installs the pinned npm packages, builds and starts the Rust scenario server on 127.0.0.1,
# runs every scenario over SSE and protobuf, and ends with "N passed, N failed".
# Exits non-zero on any failure. Called by the lead's .ci/run.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

fail() {
  echo "agui conformance: $*" >&2
  echo "0 passed, 1 failed"
  exit 1
}

cd "$here" || fail "no harness directory"
npm ci --no-audit --no-fund --loglevel=error || fail "npm ci failed"

cd "$root" || fail "no workspace"
cargo build -q -p tether-agui --example conformance_server || fail "cargo build failed"
target_dir="${CARGO_TARGET_DIR:-}"
if [ -z "$target_dir" ]; then
  target_dir="$(cargo metadata --format-version 1 --no-deps |
    node -e 'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.parse(s).target_directory))')" ||
    fail "cargo metadata failed"
fi
bin="$target_dir/debug/examples/conformance_server"
[ -x "$bin" ] || fail "no server binary at $bin"

work="$(mktemp -d)"
fifo="$work/stdin"
log="$work/server.log"
mkfifo "$fifo"
# The server exits when its stdin closes: fd 3 holds the write end for as long as we run.
"$bin" <"$fifo" >"$log" 2>&1 &
pid=$!
exec 3>"$fifo"
cleanup() {
  exec 3>&- 2>/dev/null
  sleep 0.2
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

port=""
for _ in $(seq 1 300); do
  port="$(sed -n 's/^PORT=\([0-9]*\)$/\1/p' "$log" | head -n1)"
  [ -n "$port" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$port" ]; then
  cat "$log" >&2
  fail "the conformance server did not start"
fi

cd "$here" || fail "no harness directory"
out="$(node run-scenarios.mjs "http://127.0.0.1:$port")"
rc=$?
echo "$out" | sed '$d'
if [ $rc -ne 0 ]; then
  echo "--- server log ---" >&2
  tail -n 50 "$log" >&2
fi
counts() { echo "$1" | grep -Eo '^[0-9]+ passed, [0-9]+ failed' | tail -1; }
c1="$(counts "$out")"

# tether serve hosting an ACP agent (the ACP SDK's example agent), an Anthropic, a Managed Agents and an AgentCore agent (the
# testkit fakes), judged by the same client: serve-providers.mjs.
(cd "$root" && cargo build -q -p tether-serve --bin tether-serve --example fake_anthropic --example fake_managed --example fake_agentcore) || fail "cargo build (tether-serve) failed"
[ -f "$root/conformance/acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js" ] ||
  bash "$root/conformance/acp/setup.sh" || fail "conformance/acp/setup.sh failed"
export TETHER_SERVE_BIN="$target_dir/debug/tether-serve" FAKE_ANTHROPIC_BIN="$target_dir/debug/examples/fake_anthropic" FAKE_MANAGED_BIN="$target_dir/debug/examples/fake_managed" FAKE_AGENTCORE_BIN="$target_dir/debug/examples/fake_agentcore"
out2="$(timeout 600 node serve-providers.mjs)"
rc2=$?
echo "$out2" | sed '$d'
c2="$(counts "$out2")"
p=$(( ${c1%% *} + ${c2%% *} ))
f1="${c1#*, }"; f2="${c2#*, }"
f=$(( ${f1%% *} + ${f2%% *} ))
[ -z "$c1" ] && f=$((f + 1))
[ -z "$c2" ] && f=$((f + 1))
[ $rc -ne 0 ] && [ "${f1%% *}" = 0 ] && f=$((f + 1))
[ $rc2 -ne 0 ] && [ "${f2%% *}" = 0 ] && f=$((f + 1))
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
