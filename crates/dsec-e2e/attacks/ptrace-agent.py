# Attach to, read or signal the sandbox's agent (PID 1): at every isolation level it runs
# as root with the same capabilities as this program, so only its being non-dumpable
# stands between the two. An agent stopped or rewritten could forge every result.
import ctypes, os, signal

libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_SEIZE = 16, 17, 0x4206

def report(what, escaped):
    print(("escaped: " if escaped else "contained: ") + what)

for name, req in (("attach", PTRACE_ATTACH), ("seize", PTRACE_SEIZE)):
    r = libc.ptrace(req, 1, None, None)
    report(f"ptrace {name} to PID 1 (rc={r}, errno={ctypes.get_errno()})", r == 0)
    if r == 0:
        libc.ptrace(PTRACE_DETACH, 1, None, None)
try:
    with open("/proc/1/mem", "rb") as f:
        f.seek(0x400000)
        f.read(16)
    report("read /proc/1/mem", True)
except OSError as e:
    report(f"read /proc/1/mem: {e.strerror}", False)

class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

buf = ctypes.create_string_buffer(16)
local, remote = iovec(ctypes.addressof(buf), 16), iovec(0x400000, 16)
libc.process_vm_readv.restype = ctypes.c_ssize_t
n = libc.process_vm_readv(1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
report(f"process_vm_readv of PID 1 (rc={n}, errno={ctypes.get_errno()})", n > 0)
for path in ("/proc/1/environ", "/proc/1/maps"):
    try:
        with open(path, "rb") as f:
            got = f.read(64)
        report(f"{path} readable ({len(got)} bytes)", len(got) > 0)
    except OSError as e:
        report(f"{path}: {e.strerror}", False)
# Root may list the numbers (directory permissions); following one needs ptrace access.
try:
    fds = os.listdir("/proc/1/fd")
except OSError:
    fds = []
followed = []
for fd in fds:
    try:
        followed.append(os.readlink(f"/proc/1/fd/{fd}"))
    except OSError:
        pass
report(f"PID 1's descriptors followed: {followed[:3]} of {len(fds)}", bool(followed))
os.kill(1, signal.SIGKILL)  # PID 1 ignores signals it has no handler for
report("SIGKILL to PID 1 ignored", False)
