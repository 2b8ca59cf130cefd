# shellcheck shell=sh
#
# Sourced by every scenario.  Scenarios run on the machine that runs vagrant,
# from any directory, and reach the FreeBSD hosts with `vagrant ssh`:
#
#   KEEL_HARNESS=multi (default)  hosts are the VMs cp, node1, node2
#   KEEL_HARNESS=single           hosts are VNET jails in the VM "keel"
#
# Output: one "PASS: scenario: check" or "FAIL: scenario: check" line per
# check, then a "PASS: scenario" or "FAIL: scenario" summary; the exit status
# is 0 only if every check passed.  "SKIP: scenario: reason" (exit 0) means the
# scenario cannot run in this setup.

MODE=${KEEL_HARNESS:-multi}
VAGRANT_DIR=$(cd "$(dirname "$0")/.." && pwd)
CP_ADDR_multi=192.168.56.10:7440
CP_ADDR_single=192.168.77.10:7440
failures=0

pass() { echo "PASS: ${SCENARIO}: $*"; }
fail() { echo "FAIL: ${SCENARIO}: $*"; failures=$((failures + 1)); }
skip() { echo "SKIP: ${SCENARIO}: $*"; exit 0; }

# check DESCRIPTION CMD [ARG...]: PASS if the command succeeds.
check()
{
	desc=$1
	shift
	if "$@" >/dev/null 2>&1; then pass "${desc}"; else fail "${desc}"; fi
}

finish()
{
	if [ "${failures}" -gt 0 ]; then
		echo "FAIL: ${SCENARIO} (${failures} failed)"
		exit 1
	fi
	echo "PASS: ${SCENARIO}"
	exit 0
}

# quote ARG: ARG as one single-quoted sh word.
quote()
{
	printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

# on HOST CMD [ARG...]: run CMD as root on HOST (cp, node1, node2); standard
# input is passed through, so specs can be piped in.
on()
{
	host=$1
	shift
	cmd=""
	for arg in "$@"; do
		cmd="${cmd} $(quote "${arg}")"
	done
	if [ "${MODE}" = single ]; then
		(cd "${VAGRANT_DIR}" && vagrant ssh keel -c "sudo jexec ${host}${cmd}" 2>/dev/null)
	else
		(cd "${VAGRANT_DIR}" && vagrant ssh "${host}" -c "sudo${cmd}" 2>/dev/null)
	fi
}

# kctl NODE ARG...: keelctl against NODE's own agent socket.
kctl()
{
	node=$1
	shift
	if [ "${MODE}" = single ]; then
		on "${node}" /usr/local/bin/keelctl --socket "/var/run/keel/${node}.sock" "$@"
	else
		on "${node}" /usr/local/bin/keelctl "$@"
	fi
}

# cpctl ARG...: keelctl through the control plane, signed with the operator key.
cpctl()
{
	if [ "${MODE}" = single ]; then
		addr=${CP_ADDR_single}
	else
		addr=${CP_ADDR_multi}
	fi
	on cp /usr/local/bin/keelctl --controlplane "${addr}" \
		--key-file /usr/local/etc/keel/operator.key "$@"
}

# pool_of NODE: the pool holding NODE's {pool}/keel.
pool_of()
{
	if [ "${MODE}" = single ]; then echo "keel_$1"; else echo keel; fi
}

# release_of NODE: the FreeBSD release of NODE, which names its base.
release_of()
{
	on "$1" freebsd-version -u | sed 's/-p[0-9]*$//' | tr -d '\r'
}

# jail_address NODE JAIL: the IPv4 address of JAIL's epair, as seen inside it.
jail_address()
{
	on "$1" jexec "$2" ifconfig -a inet | tr -d '\r' |
		awk '$1 == "inet" && $2 !~ /^127\./ { print $2; exit }'
}

# wait_for SECONDS CMD [ARG...]: poll CMD once a second until it succeeds or
# SECONDS pass; the status says which.
wait_for()
{
	deadline=$(($(date +%s) + $1))
	shift
	until "$@" >/dev/null 2>&1; do
		if [ "$(date +%s)" -ge "${deadline}" ]; then
			return 1
		fi
		sleep 1
	done
}

# A long-running workload in the FreeBSD base system.
# shellcheck disable=SC2034 # used by the scenarios that source this file
WORKLOAD='["/bin/sleep", "100000000"]'
