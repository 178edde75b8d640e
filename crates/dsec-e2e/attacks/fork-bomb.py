# Fork bomb: every process forks forever. The pids limit (128) stops it; the sandbox
# stays usable once the bomb is killed.
import os, signal, time

leader = os.fork()
if leader == 0:
    os.setpgid(0, 0)
    # 128 forked interpreters can fill the sandbox's memory: if the OOM killer steps in,
    # it must take bomb processes, not this reporter (raising one's own score needs no
    # privilege; its forks inherit it).
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    # The bomb runs at the lowest priority (its forks inherit it), so this reporter
    # still gets to count on a slow single-CPU guest (a microVM under TCG): this is an
    # attack on the process limit (the CPU a sandbox takes is bounded by its cgroup's
    # quota on the host, whatever its processes' nice values).
    os.nice(19)
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
time.sleep(5)


def user_process(pid):
    """Not a kernel thread (a microVM's /proc lists its guest kernel's threads too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        return not flags & 0x00200000  # PF_KTHREAD
    except (OSError, ValueError, IndexError):
        return True


peak = len([p for p in os.listdir("/proc") if p.isdigit() and user_process(p)])
os.killpg(leader, signal.SIGKILL)
os.waitpid(leader, 0)
if peak <= 130:
    print(f"contained: fork bomb peaked at {peak} processes (limit 128)")
else:
    print(f"escaped: fork bomb reached {peak} processes")
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("contained: can fork again after the bomb")
