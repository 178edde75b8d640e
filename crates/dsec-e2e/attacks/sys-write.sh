# Writing to /sys: the sandbox's sysfs is read-only, cgroups are not reachable for writing.
for f in /sys/kernel/mm/transparent_hugepage/enabled /sys/fs/cgroup/cgroup.procs /sys/class/net/lo/mtu; do
  if echo 1 > "$f" 2>/dev/null; then echo "escaped: wrote $f"; else echo "contained: $f not writable"; fi
done
