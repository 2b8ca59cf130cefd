#!/bin/sh
#
# The control-plane VM (multi-VM mode), as root, after common.sh: listen on the
# private network and start keel-controlplane from rc.d.

set -eu

: "${KEEL_LISTEN:?set by the Vagrantfile}"

cat >> /usr/local/etc/keel.toml <<TOML

[controlplane]
listen = "${KEEL_LISTEN}"

[ctl]
controlplane = "${KEEL_LISTEN}"
TOML

keel-controlplane --check-config >/dev/null
sysrc keel_controlplane_enable=YES >/dev/null
service keel_controlplane restart
