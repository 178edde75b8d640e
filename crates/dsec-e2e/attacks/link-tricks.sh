# Hard and symbolic links toward what the sandbox must not reach. Hard links cannot
# cross file systems, and the sandbox's writable disk holds nothing of the host; a
# symlink resolves inside the sandbox's own root.
try_ln() { # try_ln DESCRIPTION SOURCE: a hard link to SOURCE must fail
  if ln "$2" /tmp/hl 2>/dev/null; then echo "escaped: hard link to $1"; rm -f /tmp/hl
  else echo "contained: hard link to $1 refused"; fi
}
try_ln "PID 1's memory" /proc/1/mem
try_ln "a kernel file in /sys" /sys/kernel/uevent_seqnum
try_ln "a device node" /dev/null
ln -sf / /tmp/root-link
target="/tmp/root-link$HOST_STATE_DIR"
# The host's state directory must not appear through it. (gVisor's 2022 kernel resolves
# any path through a symlink to / as / itself: the sandbox's own root, not the host's.)
if { [ ! -e "$target" ] || [ "$target" -ef / ]; } && [ /tmp/root-link/.. -ef / ]; then
  echo "contained: a symlink to / stays in the sandbox's root"
else
  echo "escaped: a symlink reached the host's tree"
fi
