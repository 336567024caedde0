#!/usr/bin/env bash
# The test suite: fetches SmolLM2 (cached) so its tests run, then every crate's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-smollm2.sh >/dev/null
export DFLASH_REQUIRE_SMOLLM2=1
cargo test --workspace --release "$@"
