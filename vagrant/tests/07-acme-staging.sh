#!/bin/sh
# shellcheck disable=SC2317 # helper functions run through check and wait_for
#
# ACME against Let's Encrypt *staging* with DNS-01 through OVH: an Ingress for
# a real name under a zone hosted at OVH gets a certificate, served by the
# ingress jail on node1.  Runs only with credentials in the environment:
#
#   OVH_APPLICATION_KEY, OVH_APPLICATION_SECRET, OVH_CONSUMER_KEY
#   KEEL_ACME_DOMAIN   a name in a zone those credentials may edit
#   OVH_ENDPOINT       optional, default https://eu.api.ovh.com/1.0
#
# and 06-pf-redirect's ingress settings on node1.  Staging certificates are not
# trusted by browsers; that is the point: no production rate limit is spent.

SCENARIO=07-acme-staging
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "$0")/lib.sh"

for var in OVH_APPLICATION_KEY OVH_APPLICATION_SECRET OVH_CONSUMER_KEY KEEL_ACME_DOMAIN; do
	eval "value=\${${var}:-}"
	if [ -z "${value}" ]; then
		skip "${var} is not set: ACME against Let's Encrypt staging needs OVH credentials and a domain (see the header of this script)"
	fi
done

release=$(release_of node1)

# The credentials file, mode 0600, written on node1 from standard input so the
# secrets never appear on a command line.
credentials()
{
	cat <<TOML
application_key = "${OVH_APPLICATION_KEY}"
application_secret = "${OVH_APPLICATION_SECRET}"
consumer_key = "${OVH_CONSUMER_KEY}"
TOML
}
spec()
{
	cat <<YAML
kind: Service
metadata:
  name: t07
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
  name: t07
spec:
  host: ${KEEL_ACME_DOMAIN}
  service: t07
YAML
}
issued() { cpctl --node node1 get ingresses | grep "${KEEL_ACME_DOMAIN}" | grep -q -i ready; }

if credentials | on node1 sh -c 'umask 077 && cat > /usr/local/etc/keel/ovh.toml'; then
	pass "OVH credentials installed on node1"
else
	fail "OVH credentials installed on node1"
fi
if spec | cpctl --node node1 apply -f -; then pass "apply service and ingress"; else fail "apply service and ingress"; fi
# DNS propagation alone may take minutes (ingress.propagation_timeout).
if wait_for 900 issued; then
	pass "certificate issued by Let's Encrypt staging"
else
	fail "certificate issued within 15 min (see: keelctl get ingresses, and syslog on node1)"
fi

check "delete ingress" cpctl --node node1 delete ingress t07
check "delete service" cpctl delete service t07
on node1 rm -f /usr/local/etc/keel/ovh.toml
finish
