#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# A Service with 2 replicas gets a VIP; a client on another node reaches the
# replicas through it, and both replicas answer over a few connections.

SCENARIO=04-service-vip
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)

# Each replica answers every connection on port 8080 with its host name.
spec()
{
	cat <<YAML
kind: Service
metadata:
  name: t04
spec:
  replicas: 2
  port: 8080
  template:
    base: ${release}
    exec:
      start: ["/bin/sh", "-c", "while :; do hostname | nc -N -l 8080; done"]
YAML
}
ready() { cpctl get services | tr -d '\r' | awk '$1 == "t04" { print $3 }' | grep -q '^2/2$'; }
gone() { ! cpctl get services | grep -q '^t04 '; }

if spec | cpctl apply -f -; then pass "apply service t04"; else fail "apply service t04"; fi
if wait_for 120 ready; then pass "2/2 replicas ready"; else fail "2/2 replicas ready within 120 s"; fi

vip=$(cpctl get services | tr -d '\r' | awk '$1 == "t04" { print $2 }')
case "${vip}" in
*:8080) pass "VIP ${vip}" ;;
*) fail "VIP:PORT of t04 (got '${vip}')" ;;
esac
ip=${vip%:*}

# The client is node2, whichever nodes the replicas landed on.
answers=""
for _ in 1 2 3 4 5 6; do
	answers="${answers} $(on node2 nc -w 5 "${ip}" 8080 </dev/null | tr -d '\r')"
done
count=$(echo "${answers}" | tr ' ' '\n' | grep -c 't04-' | tr -d ' ')
if [ "${count}" -ge 6 ]; then
	pass "6 connections through the VIP from node2 answered"
else
	fail "6 connections through the VIP from node2 answered (got:${answers})"
fi
if echo "${answers}" | grep -q t04-0 && echo "${answers}" | grep -q t04-1; then
	pass "both replicas served"
else
	fail "both replicas served (got:${answers})"
fi

check "delete service" cpctl delete service t04
if wait_for 60 gone; then pass "service gone"; else fail "service gone within 60 s"; fi
finish
