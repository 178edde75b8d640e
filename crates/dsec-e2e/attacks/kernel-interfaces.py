# Syscalls that reach deep into the kernel: BPF, perf, kexec, keyrings, userfaultfd; calls
# off the allowlist; ioctls that dodge file protections or inject terminal input (also
# with the command's ignored high bits set); vsock sockets to the hypervisor.
import ctypes
import os
import socket

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# At isolation level gvisor these calls are answered by gVisor's kernel in user space,
# never the host's: whatever it answers, the host kernel was not reached.
GVISOR = os.environ.get("DSEC_ISOLATION") == "gvisor"


def gvisor_answered(name, r, err):
    if GVISOR:
        print(f"contained: {name} answered by gVisor's kernel, not the host's (rc={r}, errno {err})")
    return GVISOR
# x86_64 numbers.
attempts = {
    "bpf(BPF_PROG_LOAD)": (321, 5, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "kexec_load": (246, 0, 0, 0, 0),
    "keyctl(KEYCTL_JOIN_SESSION_KEYRING)": (250, 1, 0),
    "userfaultfd": (323, 0),
    "add_key": (248, 0, 0, 0, 0, 0),
}
# Off the allowlist: the kernel would answer these (0 or EBADF); the filter makes them
# look absent (ENOSYS).
attempts.update({
    "modify_ldt(read)": (154, 0, 0, 0),
    "pidfd_getfd": (438, -1, 0, 0),
    "get_mempolicy": (239, 0, 0, 0, 0, 0),
    "personality(ADDR_NO_RANDOMIZE)": (135, 0x0040000),
})
for name, args in attempts.items():
    r = libc.syscall(*[ctypes.c_long(a) for a in args])
    err = ctypes.get_errno()
    # EPERM (1) or ENOSYS (38): refused before the kernel looked at the arguments.
    if gvisor_answered(name, r, err):
        continue
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
buf = ctypes.create_string_buffer(256)
for name, cmd in ioctls.items():
    # The kernel reads the command as 32 bits: a filter comparing 64 would miss these.
    for label, value in ((name, cmd), (name + " with high bits", cmd | (1 << 32))):
        r = libc.syscall(ctypes.c_long(16), ctypes.c_long(fd), ctypes.c_ulong(value), buf)
        err = ctypes.get_errno()
        if gvisor_answered(label, r, err):
            continue
        if r >= 0:
            print(f"escaped: {label} succeeded")
        elif err == 1:
            print(f"contained: {label} refused (errno 1)")
        else:
            print(f"escaped: {label} reached the kernel (errno {err})")

# A vsock socket could reach services of the hypervisor the node runs on.
try:
    socket.socket(40, socket.SOCK_STREAM)
    if not gvisor_answered("AF_VSOCK socket", 0, 0):
        print("escaped: AF_VSOCK socket created")
except OSError as e:
    if gvisor_answered("AF_VSOCK socket", -1, e.errno):
        pass
    elif e.errno == 1:
        print("contained: AF_VSOCK socket refused (errno 1)")
    else:
        print(f"escaped: AF_VSOCK reached the kernel (errno {e.errno})")
