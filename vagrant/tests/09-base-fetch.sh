#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# keelctl base fetch: the provisioned base is left alone ("already present");
# with KEEL_FETCH_RELEASE set (a release the mirror or the archive carries,
# other than the node's own), a real download from agent.base_mirror is
# verified, extracted and snapshotted, and a jail runs on it. A release that
# exists nowhere fails and leaves no dataset.

SCENARIO=09-base-fetch
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)
pool=$(pool_of node1)

if kctl node1 base fetch "${release}" | grep -q "already present"; then
	pass "the provisioned base ${release} is already present"
else
	fail "base fetch ${release} says already present"
fi
if kctl node1 base fetch 1.0-NOSUCH; then
	fail "a release no mirror has is refused"
else
	pass "a release no mirror has is refused"
fi
no_dataset() { ! on node1 zfs list -H "${pool}/keel/bases/1.0-NOSUCH"; }
check "no dataset for it" no_dataset

fetch_release=${KEEL_FETCH_RELEASE:-}
if [ -z "${fetch_release}" ]; then
	echo "NOTE: ${SCENARIO}: set KEEL_FETCH_RELEASE (e.g. a supported release other than ${release}) for a real download"
	finish
fi
if kctl node1 base fetch "${fetch_release}"; then pass "base fetch ${fetch_release}"; else fail "base fetch ${fetch_release}"; fi
check "@keel snapshot taken" on node1 zfs list -H -t snapshot "${pool}/keel/bases/${fetch_release}@keel"
mountpoint=$(on node1 zfs get -H -o value mountpoint "${pool}/keel/bases/${fetch_release}" | tr -d '\r')
check "the base holds the release" on node1 test -x "${mountpoint}/bin/sh"
spec()
{
	cat <<YAML
kind: Jail
metadata:
  name: t08
spec:
  base: ${fetch_release}
  exec:
    start: ${WORKLOAD}
YAML
}
running() { kctl node1 get jails t08 | grep -q Running; }
if spec | kctl node1 apply -f -; then pass "apply on the fetched base"; else fail "apply on the fetched base"; fi
if wait_for 60 running; then pass "t08 Running"; else fail "t08 Running"; fi
check "delete" kctl node1 delete jail t08
finish
