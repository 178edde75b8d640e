# mount, unshare, setns, chroot tricks.
try() { # try DESCRIPTION COMMAND...: the command must fail
  what=$1; shift
  if "$@" >/dev/null 2>&1; then echo "escaped: $what"; else echo "contained: $what denied"; fi
}
mkdir -p /mnt/x
try "mount proc" mount -t proc proc /mnt/x
try "bind-mount /" mount --bind / /mnt/x
try "new user namespace" unshare -U -r true
try "new mount namespace" unshare -m true
try "new network namespace" unshare -n true
try "join PID 1's mount namespace via setns" nsenter -t 1 -m -- true
try "mknod a block device" mknod /tmp/sda b 8 0
try "load a kernel module" sh -c 'modprobe dummy || insmod /dev/null'
try "set the clock" date -s '2001-01-01'
