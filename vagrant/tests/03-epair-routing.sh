#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# Jails on different nodes reach each other: each node's jails sit on its
# keel0 bridge in its own /24, and the agents route to the other nodes' /24s.

SCENARIO=03-epair-routing
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

release=$(release_of node1)

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
YAML
}

if spec t03a | cpctl --node node1 apply -f -; then pass "apply t03a on node1"; else fail "apply t03a on node1"; fi
if spec t03b | cpctl --node node2 apply -f -; then pass "apply t03b on node2"; else fail "apply t03b on node2"; fi
a=$(jail_address node1 t03a)
b=$(jail_address node2 t03b)
if [ -n "${a}" ] && [ -n "${b}" ]; then
	pass "addresses t03a=${a} t03b=${b}"
	check "t03a (node1) pings t03b (node2)" on node1 jexec t03a ping -c 3 -t 10 "${b}"
	check "t03b (node2) pings t03a (node1)" on node2 jexec t03b ping -c 3 -t 10 "${a}"
else
	fail "addresses of t03a and t03b (got '${a}' and '${b}')"
fi

check "delete t03a" cpctl delete jail t03a
check "delete t03b" cpctl delete jail t03b
finish
