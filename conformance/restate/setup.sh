#!/usr/bin/env bash
# Installs the pinned Restate server (@restatedev/restate-server, see package-lock.json) that
# tether-restate's tests run, and checks that it starts. A missing server fails the tests; this
# script makes it present.
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund --loglevel=error
./node_modules/.bin/restate-server --version
