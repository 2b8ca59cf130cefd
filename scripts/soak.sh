#!/bin/sh
# Load soak (docs/reliability.md): keel-controlplane --simulate with
# three keel-agentd --simulate and 1,000 simulated nodes heartbeating, under
# continuous applies and deletes, for SECONDS (default 600). Checks that no
# request fails and that the daemons' VmRSS and open file descriptors stay
# under the bounds tests/soak.rs asserts; prints the figures. Linux (reads
# /proc). Exits non-zero if a check failed.
#
#   scripts/soak.sh [SECONDS]
set -eu

secs=${1:-600}
case $secs in
*[!0-9]* | '') echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

echo "soak: $secs s on $(uname -sm), $(nproc 2>/dev/null || echo '?') CPUs, $(date -u +%Y-%m-%dT%H:%MZ)"
cargo build --tests --quiet
start=$(date +%s)
status=0
KEEL_SOAK_SECS="$secs" cargo test --quiet --test integration soak::soak -- \
	--ignored --exact --nocapture --test-threads=1 || status=$?
end=$(date +%s)
echo "soak: $((end - start)) s in all"
exit $status
