#!/bin/sh
#
# Regenerates port/Makefile.crates from Cargo.lock, byte for byte what the
# ports framework's `make cargo-crates` prints (Mk/Scripts/cargo-crates.awk):
# one "name-version" per crates.io package, in Cargo.lock order, as a
# backslash-continued CARGO_CRATES= assignment.  Run it after every change to
# Cargo.lock, then `make makesum` in the port; tests/packaging.rs fails when the
# two files disagree.
#
# usage: scripts/cargo-crates.sh            rewrite port/Makefile.crates
#        scripts/cargo-crates.sh --stdout   print the list instead

set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
lock="${root}/Cargo.lock"
out="${root}/port/Makefile.crates"

if [ ! -r "${lock}" ]; then
	echo "cargo-crates.sh: ${lock} not found; run 'cargo generate-lockfile' first" >&2
	exit 1
fi
if grep -q '^source = "git+' "${lock}"; then
	# cargo-crates.awk turns git sources into GH_TUPLE/GL_TUPLE lines that
	# also need Makefile changes: let the framework do that.
	echo "cargo-crates.sh: Cargo.lock has git dependencies; use 'make cargo-crates' in the port" >&2
	exit 1
fi

list()
{
	awk '
	function add_crate() {
		if (source == "registry+https://github.com/rust-lang/crates.io-index")
			crates[n++] = name "-" version
		name = version = source = ""
	}
	/^\[\[package\]\]$/ { add_crate() }
	/^name = ".*"/ { name = $3; gsub(/"/, "", name) }
	/^version = ".*"/ { version = $3; gsub(/"/, "", version) }
	/^source = ".*"/ { source = $3; gsub(/"/, "", source) }
	END {
		add_crate()
		start = "CARGO_CRATES="
		for (i = 0; i < n; i++) {
			end = (i == n - 1) ? "\n" : " \\\n"
			printf "%s\t%s%s", start, crates[i], end
			start = "\t"
		}
	}' "${lock}"
}

case "${1:-}" in
--stdout)
	list
	;;
"")
	list > "${out}.tmp"
	mv "${out}.tmp" "${out}"
	echo "wrote ${out}; now run 'make makesum' in the port"
	;;
*)
	echo "usage: $0 [--stdout]" >&2
	exit 2
	;;
esac
