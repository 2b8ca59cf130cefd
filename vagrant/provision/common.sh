#!/bin/sh
#
# Every VM of the harness, as root: the Rust toolchain, Keel built from the
# synced checkout and installed where the port installs it, the kernel
# prerequisites (RACCT, VIMAGE modules, pf with Keel's anchors, forwarding), a
# ZFS pool on a file vdev holding {pool}/keel and a base built from base.txz,
# and a first /usr/local/etc/keel.toml that the role scripts complete.
# Idempotent: `vagrant provision` runs it again safely.

set -eu

SRC=/home/vagrant/keel
POOL=${KEEL_POOL:-keel}
POOL_FILE=/var/keel-pool.img
POOL_SIZE=${KEEL_POOL_SIZE:-10g}

log() { echo "==> $*"; }

# 14.5-RELEASE-p3 -> 14.5-RELEASE: bases are named after the release.
release=$(freebsd-version -u | sed 's/-p[0-9]*$//')

log "packages: rust, curl"
env ASSUME_ALWAYS_YES=yes pkg install -q rust curl

log "building Keel from ${SRC}"
cd "${SRC}"
CARGO_HOME=/root/.cargo cargo build --release --locked

log "installing Keel as the port does (daemons in sbin, keelctl in bin)"
install -m 555 target/release/keel-agentd target/release/keel-controlplane /usr/local/sbin/
install -m 555 target/release/keelctl /usr/local/bin/
install -m 555 rc.d/keel_agentd rc.d/keel_controlplane /usr/local/etc/rc.d/
install -m 644 etc/keel.toml.sample /usr/local/etc/
install -m 444 man/keel.toml.5 /usr/local/share/man/man5/
install -m 444 man/keel-agentd.8 man/keel-controlplane.8 man/keelctl.8 /usr/local/share/man/man8/
install -d -m 700 /usr/local/etc/keel
# Signing keys for the cluster, made on the host before `vagrant up`
# (README.md); the same files on every VM.
for key in node operator; do
	if [ -f "${SRC}/vagrant/keys/${key}.key" ]; then
		install -m 600 "${SRC}/vagrant/keys/${key}.key" /usr/local/etc/keel/
	else
		echo "WARNING: vagrant/keys/${key}.key missing: signed cluster requests will fail (README.md)" >&2
	fi
done

log "kernel: RACCT, bridge, epair, pf, ZFS"
sysrc -f /boot/loader.conf kern.racct.enable=1 zfs_load=YES if_bridge_load=YES \
	if_epair_load=YES pf_load=YES >/dev/null
kldload -n zfs if_bridge if_epair pf
sysrc zfs_enable=YES pf_enable=YES gateway_enable=YES >/dev/null
sysctl net.inet.ip.forwarding=1 >/dev/null

log "pf.conf with jail egress (NAT) and Keel's anchors"
ext_if=$(route -n get default | awk '/interface:/ { print $2 }')
cat > /etc/pf.conf <<PF
# Keel test harness (vagrant/provision/common.sh), as docs/operations.md.
ext_if = "${ext_if}"
keel_jails = "10.20.0.0/16"
set skip on lo0
nat on \$ext_if inet from \$keel_jails to ! \$keel_jails -> (\$ext_if)
rdr-anchor "keel/*"
anchor "keel/*"
pass all
PF
pfctl -nf /etc/pf.conf
service pf restart >/dev/null 2>&1 || service pf start

log "ZFS pool ${POOL} on ${POOL_FILE}"
if ! zpool list -H "${POOL}" >/dev/null 2>&1; then
	truncate -s "${POOL_SIZE}" "${POOL_FILE}"
	zpool create "${POOL}" "${POOL_FILE}"
fi
zfs list -H "${POOL}/keel" >/dev/null 2>&1 || zfs create -o mountpoint=none "${POOL}/keel"

base="${POOL}/keel/bases/${release}"
basedir="/usr/local/jails/keel-bases/${release}"
if ! zfs list -H -t snapshot "${base}@keel" >/dev/null 2>&1; then
	log "base ${release} from base.txz"
	zfs create -p -o mountpoint="${basedir}" "${base}"
	fetch -o /var/tmp/base.txz \
		"https://download.freebsd.org/releases/$(uname -m)/$(uname -p)/${release}/base.txz"
	tar -xf /var/tmp/base.txz -C "${basedir}"
	cp /etc/resolv.conf "${basedir}/etc/"
	zfs snapshot "${base}@keel"
	rm -f /var/tmp/base.txz
fi
if ! zfs list -H -t snapshot "${base}-nginx@keel" >/dev/null 2>&1; then
	log "base ${release}-nginx (the ingress jail's: nginx installed with pkg -r)"
	zfs list -H "${base}-nginx" >/dev/null 2>&1 ||
		zfs clone -o mountpoint="${basedir}-nginx" "${base}@keel" "${base}-nginx"
	env ASSUME_ALWAYS_YES=yes pkg -r "${basedir}-nginx" install -q nginx
	zfs snapshot "${base}-nginx@keel"
fi

log "/usr/local/etc/keel.toml (the role script adds its section)"
cat > /usr/local/etc/keel.toml <<TOML
# Written by vagrant/provision/common.sh; see keel.toml(5).
[zfs]
pool = "${POOL}"

[ingress]
base = "${release}-nginx"
TOML

if [ "$(sysctl -n kern.racct.enable)" != 1 ]; then
	echo "NOTE: kern.racct.enable is set in /boot/loader.conf but needs a reboot:"
	echo "      run 'vagrant reload' once provisioning is done."
fi
