#!/usr/bin/env bash
# Installs the pinned Restate server (@restatedev/restate-server, see package-lock.json) that
# tether-restate's tests run, and checks that it starts. A missing server fails the tests; this
# script makes it present.
set -euo pipefail
cd "$(dirname "$0")"
# The package depends on @scarf/scarf, which reports installs unless told not to.
export SCARF_ANALYTICS=false
npm ci --no-audit --no-fund --loglevel=error
./node_modules/.bin/restate-server --version
