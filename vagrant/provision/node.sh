#!/bin/sh
#
# A node VM (multi-VM mode), as root, after common.sh: register with the
# control plane and start keel-agentd from rc.d.

set -eu

: "${KEEL_NODE_ID:?set by the Vagrantfile}"
: "${KEEL_CONTROLPLANE:?set by the Vagrantfile}"
: "${KEEL_ADVERTISE:?set by the Vagrantfile}"

cat >> /usr/local/etc/keel.toml <<TOML

[agent]
node_id = "${KEEL_NODE_ID}"
controlplane = "${KEEL_CONTROLPLANE}"
advertise_addr = "${KEEL_ADVERTISE}"
TOML

keel-agentd --check-config >/dev/null
sysrc keel_agentd_enable=YES >/dev/null
service keel_agentd restart
