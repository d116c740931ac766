#!/usr/bin/env bash
# Installs the pinned ACP conformance peers (the @agentclientprotocol/sdk 1.9.0 example agent)
# used by crates/tether-acp and crates/tether-cli tests, which fail without it. Called by
# scripts/test before `cargo test`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
agent=node_modules/@agentclientprotocol/sdk/dist/examples/agent.js
test -f "$agent" || { echo "conformance/acp/setup.sh: $agent is missing after npm ci" >&2; exit 1; }
command -v node >/dev/null || { echo "conformance/acp/setup.sh: node is not on PATH; the example agent runs on it" >&2; exit 1; }
