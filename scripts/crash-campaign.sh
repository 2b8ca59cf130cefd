#!/bin/sh
# Crash-safety campaign (docs/reliability.md): kill -9 of
# keel-agentd --simulate and of keel-controlplane --simulate at seeded random
# points in a stream of changes, KILLS times each (default 200), checking
# after every restart what tests/crash_campaign.rs lists.
#
#   scripts/crash-campaign.sh [KILLS] [SEED]
#
# A failure prints its seed; run again with that SEED to replay the same
# stream of requests and kill delays. Without SEED each campaign picks one
# from the clock and prints it. Exits non-zero if any check failed.
set -eu

kills=${1:-200}
case $kills in
*[!0-9]* | '') echo "usage: $0 [KILLS] [SEED]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

export KEEL_CRASH_KILLS="$kills"
if [ $# -ge 2 ]; then
	export KEEL_CRASH_SEED="$2"
fi

echo "crash campaign: $kills kills per daemon on $(uname -sm), $(nproc 2>/dev/null || echo '?') CPUs, $(date -u +%Y-%m-%dT%H:%MZ)"
cargo build --tests --quiet
failed=0
for t in agent_kill9_campaign_long controlplane_kill9_campaign_long controlplane_on_etcd_kill9_campaign_long service_healing_kill9_campaign_long service_healing_on_etcd_kill9_campaign_long; do
	start=$(date +%s)
	log=$(mktemp)
	# --test-threads=1: one campaign at a time, each with the machine to itself.
	if ! cargo test --quiet --test integration "crash_campaign::$t" -- \
		--ignored --exact --nocapture --test-threads=1 >"$log" 2>&1; then
		failed=1
	fi
	grep -E 'KEEL_CRASH_SEED|campaign:|panicked|seed [0-9]+|test result' "$log" || cat "$log"
	rm -f "$log"
	end=$(date +%s)
	echo "$t: $((end - start)) s"
done
exit $failed
