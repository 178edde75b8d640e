# Syscalls that reach deep into the kernel: BPF, perf, kexec, keyrings, userfaultfd; and
# ioctls that dodge file protections or inject terminal input.
import ctypes
import fcntl
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# x86_64 numbers.
attempts = {
    "bpf(BPF_PROG_LOAD)": (321, 5, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "kexec_load": (246, 0, 0, 0, 0),
    "keyctl(KEYCTL_JOIN_SESSION_KEYRING)": (250, 1, 0),
    "userfaultfd": (323, 0),
    "add_key": (248, 0, 0, 0, 0, 0),
}
for name, args in attempts.items():
    r = libc.syscall(*[ctypes.c_long(a) for a in args])
    err = ctypes.get_errno()
    # EPERM (1) or ENOSYS (38): refused before the kernel looked at the arguments.
    if r >= 0:
        print(f"escaped: {name} returned {r}")
    elif err in (1, 38):
        print(f"contained: {name} refused (errno {err})")
    else:
        print(f"escaped: {name} reached the kernel (errno {err})")

# ioctl commands: refused by the filter (EPERM) before any driver or file system sees
# them; without it they would reach the kernel (ENOTTY, EINVAL, EBADF, ...).
fd = os.open("/tmp/ioctl-target", os.O_RDWR | os.O_CREAT, 0o600)
ioctls = {
    "ioctl(TIOCSTI)": 0x5412,
    "ioctl(TIOCLINUX)": 0x541C,
    "ioctl(EXT4_IOC_MOVE_EXT)": 0xC028660F,
    "ioctl(EXT4_IOC_SWAP_BOOT)": 0x6611,
    "ioctl(XFS_IOC_SWAPEXT)": 0xC0C0586D,
}
for name, cmd in ioctls.items():
    try:
        fcntl.ioctl(fd, cmd, bytes(256))
        print(f"escaped: {name} succeeded")
    except OSError as e:
        if e.errno == 1:
            print(f"contained: {name} refused (errno 1)")
        else:
            print(f"escaped: {name} reached the kernel (errno {e.errno})")
