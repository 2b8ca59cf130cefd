#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# An Ingress on node1 makes pf redirect the public address's ports 80 and 443
# to the nginx ingress jail, in Keel's anchor, and a client on another host
# connects through the redirect.  Needs ingress.public_interface and
# ingress.public_address in node1's keel.toml (README.md), else SKIP.

SCENARIO=06-pf-redirect
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

if [ "${MODE}" = single ]; then
	config=/usr/local/etc/keel-node1.toml
else
	config=/usr/local/etc/keel.toml
fi
public=$(on node1 /usr/local/sbin/keel-agentd -c "${config}" --check-config |
	tr -d '\r' | sed -n 's/^public_address = "\(.*\)"$/\1/p')
if [ -z "${public}" ]; then
	skip "ingress.public_address is not set on node1; set it and ingress.public_interface in ${config} (README.md)"
fi
release=$(release_of node1)

spec()
{
	cat <<YAML
kind: Service
metadata:
  name: t06
spec:
  replicas: 1
  port: 8080
  template:
    base: ${release}
    exec:
      start: ["/bin/sh", "-c", "while :; do hostname | nc -N -l 8080; done"]
---
kind: Ingress
metadata:
  name: t06
spec:
  host: t06.keel.test
  service: t06
YAML
}
redirected() { on node1 pfctl -a 'keel/*' -s nat | grep -q "${public} port = http"; }

if spec | cpctl --node node1 apply -f -; then pass "apply service and ingress"; else fail "apply service and ingress"; fi
if wait_for 120 redirected; then pass "rdr rule for ${public} port 80 in keel/*"; else fail "rdr rule for ${public} port 80 in keel/* within 120 s"; fi
rules=$(on node1 pfctl -a 'keel/*' -s nat | tr -d '\r')
case "${rules}" in
*"port = https"*) pass "rdr rule for port 443" ;;
*) fail "rdr rule for port 443 (pfctl said: ${rules})" ;;
esac
check "cp connects to ${public}:80 through the redirect" on cp nc -z -w 5 "${public}" 80

check "delete ingress" cpctl --node node1 delete ingress t06
check "delete service" cpctl delete service t06
finish
