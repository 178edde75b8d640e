# A setuid-root binary run by an unprivileged user: no_new_privs keeps the user's ids.
import os, shutil, subprocess

shutil.copy("/usr/bin/id", "/tmp/suid-id")
os.chown("/tmp/suid-id", 0, 0)
os.chmod("/tmp/suid-id", 0o4755)

def as_nobody():
    os.setgid(65534)
    os.setuid(65534)

out = subprocess.run(["/tmp/suid-id", "-u"], preexec_fn=as_nobody, capture_output=True, text=True)
euid = out.stdout.strip()
if euid == "0":
    print("escaped: a setuid binary gave uid 0 to nobody")
else:
    print(f"contained: setuid binary ran with euid {euid}")
