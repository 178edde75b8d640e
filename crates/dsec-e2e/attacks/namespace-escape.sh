# mount, unshare, setns, chroot tricks.
try() { # try DESCRIPTION COMMAND...: the command must fail
  what=$1; shift
  if "$@" >/dev/null 2>&1; then echo "escaped: $what"; else echo "contained: $what denied"; fi
}
mkdir -p /mnt/x
try "mount proc" mount -t proc proc /mnt/x
try "bind-mount /" mount --bind / /mnt/x
if [ "$DSEC_ISOLATION" = gvisor ]; then
  # gVisor's kernel makes user namespaces of its own: the host's code is not reached.
  if unshare -U -r true >/dev/null 2>&1; then
    echo "contained: new user namespace made by gVisor's kernel, not the host's"
  else
    echo "contained: new user namespace denied"
  fi
else
  try "new user namespace" unshare -U -r true
fi
try "new mount namespace" unshare -m true
try "new network namespace" unshare -n true
try "join PID 1's mount namespace via setns" nsenter -t 1 -m -- true
if [ "$DSEC_ISOLATION" = gvisor ]; then
  # gVisor's file system may record the node, but no host device is behind it.
  try "read a block device made with mknod" sh -c 'mknod /tmp/sda b 8 0 && [ "$(head -c 512 /tmp/sda | wc -c)" -gt 0 ]'
else
  try "mknod a block device" mknod /tmp/sda b 8 0
fi
try "load a kernel module" sh -c 'modprobe dummy || insmod /dev/null'
try "set the clock" date -s '2001-01-01'
