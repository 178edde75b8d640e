# The node's API and the agent's control socket, from inside.
import os, socket

port = int(os.environ["API_PORT"])
try:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    print(f"escaped: connected to 127.0.0.1:{port}")
except OSError as e:
    print(f"contained: node API port unreachable ({e.strerror})")
# The agent's listening socket is PID 1's fd 3; it has no path inside the sandbox.
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("/proc/1/fd/3")
    print("escaped: connected to the agent's listening socket through /proc/1/fd/3")
except OSError as e:
    print(f"contained: agent socket not reachable by path ({e.strerror})")
found = []
for root, dirs, files in os.walk("/", topdown=True):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/dev")]
    for f in files:
        p = os.path.join(root, f)
        try:
            if os.path.isdir(p) is False and os.stat(p, follow_symlinks=False).st_mode & 0o170000 == 0o140000:
                found.append(p)
        except OSError:
            pass
if found:
    print(f"escaped: unix sockets visible: {found[:5]}")
else:
    print("contained: no unix socket of the node in the sandbox's file system")
