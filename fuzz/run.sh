#!/usr/bin/env bash
# Builds every cargo-fuzz target and runs each for a bounded time against its committed corpus
# (fuzz/corpus/<target>, plus fuzz/regressions/<target>), as CI does at the end of scripts/test.
#
#   fuzz/run.sh                 # every target, FUZZ_SECONDS (default 10) each
#   fuzz/run.sh openai_sse ...  # only these
#   FUZZ_RUNS=10000 fuzz/run.sh # every target for exactly 10000 inputs from seed FUZZ_SEED
#                               # (default 1): the same inputs on every machine, as CI runs it
#
# A time-bounded run explores differently on every run and machine, so it belongs on a
# developer's machine; CI uses a fixed seed and input count so that its verdict is reproducible
# (a crash it reports is there on every run until fixed, and a pass is not luck).
#
# New inputs go to a scratch directory, never into the committed corpus (see README.md for how
# to grow and minimise it). A crash, panic, timeout or leak fails the run, with the input saved
# under fuzz/artifacts/<target>/ and the command that reproduces it.
#
# Needs the nightly toolchain (libFuzzer's instrumentation flags are unstable) and cargo-fuzz,
# which this script installs from crates.io, pinned, when missing.
set -euo pipefail
cd "$(dirname "$0")"

CARGO_FUZZ_VERSION=0.13.2
SECONDS_EACH="${FUZZ_SECONDS:-10}"
if [ -n "${FUZZ_RUNS:-}" ]; then
  BOUND=(-runs="$FUZZ_RUNS" -seed="${FUZZ_SEED:-1}")
  what="$FUZZ_RUNS inputs from seed ${FUZZ_SEED:-1}"
else
  BOUND=(-max_total_time="$SECONDS_EACH")
  what="${SECONDS_EACH} s"
fi

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "error: the fuzz step needs the nightly toolchain (cargo-fuzz builds with unstable" >&2
  echo "       sanitizer-coverage flags). Install it with:  rustup toolchain install nightly" >&2
  exit 1
fi
if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  echo "==> installing cargo-fuzz $CARGO_FUZZ_VERSION from crates.io"
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

# No sanitizer: the parsers are safe Rust, and libFuzzer's coverage and the targets' own
# assertions are what find their bugs; ASan would double the build for the unsafe code of
# dependencies only. (Run one target with `-s address` locally when touching unsafe code.)
FLAGS=(-s none)

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

start=$(date +%s)
echo "==> building ${#targets[@]} fuzz targets (nightly, release)"
cargo +nightly fuzz build "${FLAGS[@]}"
built=$(date +%s)
echo "    built in $((built - start)) s"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# The targets' own temporary files (a workspace per process) go under the scratch directory too:
# a fuzzing process ends without cleaning up after itself.
mkdir -p "$scratch/tmp"
export TMPDIR="$scratch/tmp"
failed=()
for t in "${targets[@]}"; do
  echo "==> fuzzing $t: $what"
  mkdir -p "$scratch/$t" "corpus/$t"
  dirs=("$scratch/$t" "corpus/$t")
  [ -d "regressions/$t" ] && dirs+=("regressions/$t")
  # -timeout: one input taking 30 s is a hang; -rss_limit_mb: a parser must not need 2 GiB.
  if ! cargo +nightly fuzz run "${FLAGS[@]}" "$t" "${dirs[@]}" -- \
    "${BOUND[@]}" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
    2>"$scratch/$t.log"; then
    tail -60 "$scratch/$t.log" >&2
    failed+=("$t")
  else
    grep -E "^stat::number_of_executed_units|^Done" "$scratch/$t.log" | tr '\n' ' '
    echo
  fi
done
echo "==> fuzzing took $(($(date +%s) - built)) s after the build ($(($(date +%s) - start)) s in all)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "error: fuzz targets failed: ${failed[*]}" >&2
  echo "       the failing inputs are in fuzz/artifacts/<target>/; reproduce one with" >&2
  echo "       (cd fuzz && cargo +nightly fuzz run -s none <target> artifacts/<target>/<file>)" >&2
  exit 1
fi
