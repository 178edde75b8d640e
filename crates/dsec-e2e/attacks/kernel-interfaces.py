# Syscalls that reach deep into the kernel: BPF, perf, kexec, keyrings, userfaultfd.
import ctypes

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
