#!/bin/sh
# Fuzz smoke run (docs/reliability.md): every cargo-fuzz target in
# fuzz/ for SECONDS each (default 60), then one line per target with its
# executions, executions per second and findings.
#
#   scripts/fuzz-smoke.sh [SECONDS] [TARGET ...]
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain
# (`rustup toolchain install nightly`): libFuzzer instrumentation needs
# nightly rustc. The corpus grows in fuzz/corpus/TARGET (not committed) from
# the checked-in seeds in fuzz/seeds/TARGET. A crash, a timeout or a leak is
# a finding: its input is kept in fuzz/artifacts/TARGET/ and the script exits
# 1 after running every target. Reproduce one with
#   cargo +nightly fuzz run -O -a TARGET fuzz/artifacts/TARGET/crash-...
# and turn it into a regression test in tests/ before fixing the parser.
set -eu

seconds=${1:-60}
[ $# -gt 0 ] && shift
case $seconds in
*[!0-9]* | '') echo "usage: $0 [SECONDS] [TARGET ...]" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
	echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
	exit 2
fi
if ! rustup toolchain list | grep -q '^nightly'; then
	echo "no nightly toolchain (libFuzzer needs one): rustup toolchain install nightly" >&2
	exit 2
fi

if [ $# -gt 0 ]; then
	targets=$*
else
	targets=$(cargo +nightly fuzz list)
fi

# -O: optimised like the daemons; -a: debug assertions (overflow checks) on.
cargo +nightly fuzz build -O -a

echo "fuzz smoke: ${seconds}s per target on $(uname -sm), $(nproc 2>/dev/null || echo '?') CPUs, $(date -u +%Y-%m-%dT%H:%MZ)"
found=0
summary=""
for t in $targets; do
	mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
	before=$(find "fuzz/artifacts/$t" -type f | wc -l)
	log="fuzz/artifacts/$t.log"
	# libFuzzer reads every directory given; only the first one grows.
	mkdir -p "fuzz/seeds/$t"
	# A finding makes cargo fuzz exit non-zero; that is reported below, not fatal here.
	cargo +nightly fuzz run -O -a "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
		-max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
		>"$log" 2>&1 || true
	runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
	rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
	after=$(find "fuzz/artifacts/$t" -type f | wc -l)
	new=$((after - before))
	corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
	line=$(printf '%-14s %12s execs %8s execs/s  corpus %6s  findings %s' \
		"$t" "${runs:-?}" "${rate:-?}" "$corpus" "$new")
	echo "$line"
	summary="$summary$line
"
	if [ "$new" -gt 0 ] || [ -z "$runs" ]; then
		found=1
		echo "  see $log and fuzz/artifacts/$t/" >&2
		grep -m 5 -E 'panicked|ERROR|SUMMARY' "$log" >&2 || true
	fi
done
echo
echo "summary"
printf '%s' "$summary"
exit $found
