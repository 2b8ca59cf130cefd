#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# Jail removal that cannot get stuck:
# - an exec.stop that always fails: a changed spec still replaces the jail
#   (jail -R after jail(8) kept it), the failure is the jail's last error, and
#   a delete still removes it, devfs and root filesystem included;
# - a crashed workload restarts with its epair: the jail end is back inside
#   the new jail, however long the old one lingers as dying;
# - a jail whose jail.conf is lost is deleted without /etc/jail.conf, its
#   devfs unmounted, its root filesystem destroyed.

SCENARIO=08-removal
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)
pool=$(pool_of node1)
if [ "${MODE}" = single ]; then
	state_dir=/var/db/keel/node1
else
	state_dir=/var/db/keel/agentd
fi

# spec NAME STOP LEVEL: a jail running WORKLOAD with exec.stop STOP and the
# environment LEVEL=LEVEL.
spec()
{
	cat <<YAML
kind: Jail
metadata:
  name: $1
spec:
  base: ${release}
  exec:
    start: ${WORKLOAD}
    stop: $2
  env: {LEVEL: $3}
YAML
}
running() { kctl node1 get jails "$1" | grep -q Running; }
gone() { ! on node1 jls -j "$1" jid; }
restarted() { kctl node1 get jails -o json "$1" | grep -Eq '"restarts": *[1-9]'; }
no_devfs() { ! on node1 mount -p -t devfs | grep -q "/$1/dev[[:space:]]"; }
no_rootfs() { ! on node1 zfs list -H "${pool}/keel/jails/$1"; }
jail_side_inside() { on node1 jexec "$1" ifconfig -l | grep -q "kj_$1"; }

# 1. exec.stop always fails.
if spec t08a '["/usr/bin/false"]' one | kctl node1 apply -f -; then pass "apply t08a"; else fail "apply t08a"; fi
check "t08a Running" running t08a
if spec t08a '["/usr/bin/false"]' two | kctl node1 apply -f -; then
	pass "a changed spec replaces t08a although exec.stop fails"
else
	fail "a changed spec replaces t08a although exec.stop fails"
fi
check "t08a Running again" running t08a
last=$(kctl node1 get jails -o json t08a | tr -d '\r')
case "${last}" in
*"jail -R t08a"*) pass "the stop failure is t08a's last error" ;;
*) fail "the stop failure is t08a's last error (got: ${last})" ;;
esac
check "delete t08a" kctl node1 delete jail t08a
if wait_for 30 gone t08a; then pass "t08a gone"; else fail "t08a gone"; fi
check "t08a's devfs unmounted" no_devfs t08a
check "t08a's root filesystem destroyed" no_rootfs t08a

# 2. A crash restart gets an epair whose jail end is inside the new jail.
if spec t08b '[]' one | kctl node1 apply -f -; then pass "apply t08b"; else fail "apply t08b"; fi
check "kj_t08b inside t08b" jail_side_inside t08b
on node1 pkill -j t08b sleep
if wait_for 60 restarted t08b; then pass "t08b restarted"; else fail "t08b restarted within 60 s"; fi
check "t08b Running after the restart" running t08b
check "kj_t08b inside the new t08b" jail_side_inside t08b
check "delete t08b" kctl node1 delete jail t08b
if wait_for 30 gone t08b; then pass "t08b gone"; else fail "t08b gone"; fi

# 3. The jail.conf is lost before the delete.
if spec t08c '["/usr/bin/true"]' one | kctl node1 apply -f -; then pass "apply t08c"; else fail "apply t08c"; fi
check "t08c Running" running t08c
check "remove t08c's jail.conf" on node1 rm "${state_dir}/jails/t08c.conf"
check "delete t08c" kctl node1 delete jail t08c
if wait_for 30 gone t08c; then pass "t08c gone"; else fail "t08c gone"; fi
check "t08c's devfs unmounted" no_devfs t08c
check "t08c's root filesystem destroyed" no_rootfs t08c
finish
