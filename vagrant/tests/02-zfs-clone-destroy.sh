#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# A jail's root filesystem is a ZFS clone of {pool}/keel/bases/<release>@keel,
# mounted under zfs.jails_dir, and is destroyed with the jail.

SCENARIO=02-zfs-clone-destroy
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)
pool=$(pool_of node1)
rootfs="${pool}/keel/jails/t02"

spec()
{
	cat <<YAML
kind: Jail
metadata:
  name: t02
spec:
  base: ${release}
  exec:
    start: ${WORKLOAD}
YAML
}
no_rootfs() { ! on node1 zfs list -H "${rootfs}"; }

if spec | kctl node1 apply -f -; then pass "apply"; else fail "apply"; fi
origin=$(on node1 zfs get -H -o value origin "${rootfs}" | tr -d '\r')
if [ "${origin}" = "${pool}/keel/bases/${release}@keel" ]; then
	pass "rootfs is a clone of the base snapshot"
else
	fail "rootfs origin is ${pool}/keel/bases/${release}@keel (zfs said: ${origin})"
fi
mounted=$(on node1 zfs get -H -o value mounted "${rootfs}" | tr -d '\r')
if [ "${mounted}" = yes ]; then pass "rootfs mounted"; else fail "rootfs mounted (zfs said: ${mounted})"; fi

check "delete" kctl node1 delete jail t02
if wait_for 30 no_rootfs; then pass "rootfs destroyed"; else fail "rootfs ${rootfs} destroyed"; fi
check "base snapshot kept" on node1 zfs list -H -t snapshot "${pool}/keel/bases/${release}@keel"
finish
