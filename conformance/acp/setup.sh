#!/usr/bin/env bash
# Installs the pinned ACP conformance peers (the @agentclientprotocol/sdk 1.9.0 example agent)
# used by crates/tether-acp and crates/tether-cli tests. Called by .ci/run before `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
npm ci --no-audit --no-fund --ignore-scripts
test -f node_modules/@agentclientprotocol/sdk/dist/examples/agent.js
