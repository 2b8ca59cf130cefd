#!/bin/sh
#
# Single-VM mode, as root, after common.sh: the hosts cp, node1 and node2 are
# VNET jails on the bridge harness0, each with its own epair and address, the
# way FreeBSD's own network tests simulate hosts (src/tests/sys/common/
# vnet.subr: `ifconfig epair create`, one end into the jail with
# vnet.interface).  Each node jail gets a pool of its own (a file vdev) whose
# {pool}/keel is delegated to it with `zfs jail`, its own pf instance with
# Keel's anchors, and runs keel-agentd with its own state, socket and
# directories; cp runs keel-controlplane.  Runs at every boot
# (run: "always"): jails do not survive a reboot.
#
# Limits of this mode (README.md): rctl(8) cannot be used inside a jail, so
# specs with resources fail here (specs without run no rctl at all); agents
# run nested VNET jails, which the kernel only lets have the node jail's devfs
# ruleset, hence jail.devfs_ruleset = "inherit" in each agent's keel.toml.

set -eu

NET=192.168.77
BRIDGE=harness0
RULESET=77
release=$(freebsd-version -u | sed 's/-p[0-9]*$//')

log() { echo "==> $*"; }

if jls -j cp jid >/dev/null 2>&1 && jls -j node1 jid >/dev/null 2>&1 &&
	jls -j node2 jid >/dev/null 2>&1; then
	log "jails cp, node1 and node2 already run; nothing to do"
	exit 0
fi

# The nested jails need /dev/pf and /dev/zfs inside the node jails.
if ! grep -q "^\[keel_harness=${RULESET}\]" /etc/devfs.rules 2>/dev/null; then
	cat >> /etc/devfs.rules <<RULES

[keel_harness=${RULESET}]
add include \$devfsrules_jail_vnet
add path pf unhide
add path zfs unhide
RULES
	service devfs restart >/dev/null
fi

ifconfig "${BRIDGE}" >/dev/null 2>&1 || ifconfig bridge create name "${BRIDGE}" >/dev/null
ifconfig "${BRIDGE}" inet "${NET}.1/24" up

# mkhost NAME ADDRESS: a VNET jail sharing the VM's filesystem, with one epair.
mkhost()
{
	if jls -j "$1" jid >/dev/null 2>&1; then
		return
	fi
	a=$(ifconfig epair create)
	b="${a%a}b"
	ifconfig "${BRIDGE}" addm "${a}"
	ifconfig "${a}" up
	jail -c name="$1" host.hostname="$1" path=/ vnet vnet.interface="${b}" \
		persist mount.devfs devfs_ruleset="${RULESET}" enforce_statfs=1 \
		children.max=100 allow.raw_sockets allow.mount allow.mount.devfs \
		allow.mount.nullfs allow.mount.zfs allow.mount.tmpfs
	jexec "$1" ifconfig lo0 inet 127.0.0.1/8 up
	jexec "$1" ifconfig "${b}" inet "$2/24" up
	jexec "$1" sysctl net.inet.ip.forwarding=1 >/dev/null
}

log "control plane jail cp (${NET}.10)"
mkhost cp "${NET}.10"
cat > /usr/local/etc/keel-cp.toml <<TOML
# Single-VM harness: the control plane in jail cp (vnet-nodes.sh).
[controlplane]
listen = "${NET}.10:7440"
state_dir = "/var/db/keel/cp"
pidfile = "/var/run/keel_cp.pid"
TOML
jexec cp /usr/local/sbin/keel-controlplane -c /usr/local/etc/keel-cp.toml --check-config >/dev/null
jexec cp /usr/local/sbin/keel-controlplane -c /usr/local/etc/keel-cp.toml --daemon

i=11
for node in node1 node2; do
	pool="keel_${node}"
	log "node jail ${node} (${NET}.${i}), pool ${pool}"
	mkhost "${node}" "${NET}.${i}"
	if ! zpool list -H "${pool}" >/dev/null 2>&1; then
		truncate -s 6g "/var/${pool}.img"
		zpool create "${pool}" "/var/${pool}.img"
		zfs create -o mountpoint=none "${pool}/keel"
		zfs create -p "${pool}/keel/bases"
		zfs send "keel/keel/bases/${release}@keel" |
			zfs receive -u "${pool}/keel/bases/${release}"
		zfs send "keel/keel/bases/${release}-nginx@keel" |
			zfs receive -u "${pool}/keel/bases/${release}-nginx"
		zfs set jailed=on "${pool}/keel"
	fi
	zfs jail "${node}" "${pool}/keel"
	jexec "${node}" pfctl -q -f /etc/pf.conf
	jexec "${node}" pfctl -q -e 2>/dev/null || true
	cat > "/usr/local/etc/keel-${node}.toml" <<TOML
# Single-VM harness: the agent in jail ${node} (vnet-nodes.sh).
[agent]
state_dir = "/var/db/keel/${node}"
socket = "/var/run/keel/${node}.sock"
pidfile = "/var/run/keel_${node}.pid"
node_id = "${node}"
controlplane = "${NET}.10:7440"
advertise_addr = "${NET}.${i}:7441"

[zfs]
pool = "${pool}"
jails_dir = "/usr/local/jails/${node}"
volumes_dir = "/usr/local/jails/${node}-volumes"

[jail]
devfs_ruleset = "inherit"

[ingress]
base = "${release}-nginx"
TOML
	jexec "${node}" /usr/local/sbin/keel-agentd -c "/usr/local/etc/keel-${node}.toml" --check-config >/dev/null
	jexec "${node}" /usr/local/sbin/keel-agentd -c "/usr/local/etc/keel-${node}.toml" --daemon
	i=$((i + 1))
done

log "single-VM harness up: cp ${NET}.10, node1 ${NET}.11, node2 ${NET}.12"
