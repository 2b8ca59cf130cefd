#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# A volume outlives its jail: data written through the mount is still there
# after the jail is deleted and applied again; delete-volume removes it.

SCENARIO=05-volume-survival
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)
pool=$(pool_of node1)

spec()
{
	cat <<YAML
kind: Jail
metadata:
  name: t05
spec:
  base: ${release}
  exec:
    start: ${WORKLOAD}
  volumes:
    - name: t05-data
      mountPath: /data
      size: 100M
YAML
}
jail_gone() { ! on node1 jls -j t05 jid; }

if spec | kctl node1 apply -f -; then pass "apply"; else fail "apply"; fi
quota=$(on node1 zfs get -H -p -o value quota "${pool}/keel/volumes/t05-data" | tr -d '\r')
if [ "${quota}" = 104857600 ]; then pass "volume quota 100M"; else fail "volume quota 100M (zfs said: ${quota})"; fi
check "write through the mount" on node1 jexec t05 sh -c 'echo keel-was-here > /data/marker'

check "delete jail" kctl node1 delete jail t05
wait_for 30 jail_gone || fail "jail t05 gone after delete"
check "volume kept after delete" on node1 zfs list -H "${pool}/keel/volumes/t05-data"

if spec | kctl node1 apply -f -; then pass "apply again"; else fail "apply again"; fi
marker=$(on node1 jexec t05 cat /data/marker | tr -d '\r')
if [ "${marker}" = keel-was-here ]; then pass "data survived"; else fail "data survived (read: '${marker}')"; fi

check "delete jail again" kctl node1 delete jail t05
wait_for 30 jail_gone || fail "jail t05 gone after the second delete"
check "delete-volume" kctl node1 delete-volume t05-data
if on node1 zfs list -H "${pool}/keel/volumes/t05-data" >/dev/null 2>&1; then
	fail "volume dataset destroyed by delete-volume"
else
	pass "volume dataset destroyed by delete-volume"
fi
finish
