#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# A jail on one node through its local socket: apply creates and starts it
# with its rctl(8) limits, it reaches the Internet through the host's NAT, a
# crashed workload is restarted, delete removes it.

SCENARIO=01-jail-lifecycle
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)
resources="  resources: {cpu: 0.5, memory: 128M}"
if [ "${MODE}" = single ]; then
	# rctl(8) is refused inside a jail, and the node is one here.
	resources=""
	echo "NOTE: ${SCENARIO}: single-VM mode, rctl limits not checked (README.md)"
fi

spec()
{
	cat <<YAML
kind: Jail
metadata:
  name: t01
spec:
  base: ${release}
${resources}
  exec:
    start: ${WORKLOAD}
YAML
}
running() { kctl node1 get jails t01 | grep -q Running; }
restarted() { kctl node1 get jails -o json t01 | grep -Eq '"restarts": *[1-9]'; }
gone() { ! on node1 jls -j t01 jid; }

if spec | kctl node1 apply -f -; then pass "apply"; else fail "apply"; fi
check "jail t01 exists (jls)" on node1 jls -j t01 jid
check "get jails shows t01 Running" running

if [ "${MODE}" = multi ]; then
	limits=$(on node1 rctl -h jail:t01 | tr -d '\r')
	case "${limits}" in
	*"memoryuse:deny=128M"*) pass "rctl memoryuse:deny=128M" ;;
	*) fail "rctl memoryuse:deny=128M (rctl said: ${limits})" ;;
	esac
	case "${limits}" in
	*"pcpu:deny=50"*) pass "rctl pcpu:deny=50" ;;
	*) fail "rctl pcpu:deny=50 (rctl said: ${limits})" ;;
	esac
fi

if [ "${MODE}" = multi ]; then
	# Egress through pf.conf's nat rule (provision/common.sh, as
	# docs/operations.md gives it): DNS, then HTTPS to the package mirror.
	check "t01 resolves pkg.FreeBSD.org (egress, DNS)" on node1 jexec t01 host -t A pkg.FreeBSD.org
	check "t01 fetches https://pkg.FreeBSD.org/ (egress, NAT)" \
		on node1 jexec t01 fetch -qo /dev/null https://pkg.FreeBSD.org/
else
	echo "NOTE: ${SCENARIO}: single-VM mode, egress not checked (the node jails have no NAT)"
fi

on node1 pkill -j t01 sleep
if wait_for 60 restarted; then
	pass "crashed workload restarted"
else
	fail "crashed workload restarted within 60 s"
fi

check "delete" kctl node1 delete jail t01
if wait_for 30 gone; then pass "jail t01 gone after delete"; else fail "jail t01 gone after delete"; fi
finish
