#!/bin/sh
#
# Runs every scenario in order and prints a summary.  Usage, from the machine
# that runs vagrant, once `vagrant up` (and `vagrant reload`) are done:
#
#   sh vagrant/tests/run-all.sh            # multi-VM harness
#   KEEL_HARNESS=single sh vagrant/tests/run-all.sh

set -u

dir=$(cd "$(dirname "$0")" && pwd)
passed=0
failed=0
for scenario in "${dir}"/[0-9][0-9]-*.sh; do
	if sh "${scenario}"; then
		passed=$((passed + 1))
	else
		failed=$((failed + 1))
	fi
done
echo "== ${passed} scenarios passed or skipped, ${failed} failed"
[ "${failed}" -eq 0 ]
