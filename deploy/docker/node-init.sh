#!/bin/sh
# Prepares a node's container for runsc without --privileged, then execs the command
# (`forkyard-node-init forkyard node serve ...`). README "Cluster", "What the container needs":
# the container runs with CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_PTRACE, the device rule
# 'b 7:* rmw' and /dev/loop-control, seccomp and AppArmor unconfined. Two things Docker does not
# give such a container, measured with this image on Docker 20.10 (cgroup v1):
# * loop devices: a sandbox's disk is a loop-mounted ext4 image; the kernel makes /dev/loopN on
#   the host's devtmpfs only, so the nodes are made here (the device rule allows them);
# * writable cgroups: Docker mounts the container's cgroup hierarchies read-only; runsc makes a
#   cgroup per sandbox under them (mkdir /sys/fs/cgroup/cpuset/forkyard: read-only file system).
# Privileged containers have both already; this script then changes nothing.
set -eu
LOOP_DEVICES=${FORKYARD_LOOP_DEVICES:-256}
i=0
while [ "$i" -lt "$LOOP_DEVICES" ]; do
  [ -e "/dev/loop$i" ] || mknod -m 0660 "/dev/loop$i" b 7 "$i"
  i=$((i + 1))
done
for hierarchy in /sys/fs/cgroup/*/; do
  if grep -qs " ${hierarchy%/} ro," /proc/self/mountinfo; then
    mount -o remount,rw,bind "$hierarchy"
  fi
done
exec "$@"
