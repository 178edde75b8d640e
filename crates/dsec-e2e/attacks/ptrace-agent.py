# Attach to, read or signal the sandbox's agent (PID 1).
import ctypes, os, signal

libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16

def report(what, escaped):
    print(("escaped: " if escaped else "contained: ") + what)

r = libc.ptrace(PTRACE_ATTACH, 1, None, None)
report(f"ptrace attach to PID 1 (rc={r}, errno={ctypes.get_errno()})", r == 0)
try:
    with open("/proc/1/mem", "rb") as f:
        f.seek(0x400000)
        f.read(16)
    report("read /proc/1/mem", True)
except OSError as e:
    report(f"read /proc/1/mem: {e.strerror}", False)
os.kill(1, signal.SIGKILL)  # PID 1 ignores signals it has no handler for
report("SIGKILL to PID 1 ignored", False)
