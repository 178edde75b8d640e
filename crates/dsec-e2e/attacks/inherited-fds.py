# Descriptors a command inherits from the agent, and what PID 1 holds: nothing that
# leads to the host.
import os

extra = []
for fd in sorted(os.listdir("/proc/self/fd"), key=int):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        continue  # the descriptor listdir itself used, closed by now
    if int(fd) > 2:
        extra.append(f"{fd} -> {target}")
if extra:
    print(f"escaped: a command inherited fds beyond stdio: {extra}")
else:
    print("contained: a command holds only stdio")

state_dir = os.environ["HOST_STATE_DIR"]
leaks, held = [], 0
try:
    pid1_fds = os.listdir("/proc/1/fd")
except PermissionError:
    pid1_fds = []  # PID 1 is not dumpable: its fds are not even listable
for fd in pid1_fds:
    try:
        target = os.readlink(f"/proc/1/fd/{fd}")
    except OSError:
        continue
    held += 1
    if target.startswith((state_dir, "/var/lib/", "/run/dsec")):
        leaks.append(target)
if leaks:
    print(f"escaped: PID 1 holds host paths: {leaks}")
else:
    print(f"contained: PID 1 holds no host path ({held} fds readable)")
