# grep -r from /: walks /proc, /sys and /dev without hanging or crashing the kernel, and
# finds nothing of the host.
# The secret arrives reversed, and grep reads it from a file: no process's argv or
# environment in here holds it, so a match can only come from the host.
python3 -c 'import sys; print(sys.argv[1][::-1])' "$HOST_SECRET_REV" > /tmp/pattern
timeout 90 grep -rslF -f /tmp/pattern / 2>/dev/null | grep -vx /tmp/pattern >/tmp/grep.out
rc=$?
rc=$(( rc == 1 ? 0 : rc ))
if [ -s /tmp/grep.out ]; then
  echo "escaped: host secret found in $(head -3 /tmp/grep.out | tr '\n' ' ')"
elif [ "$rc" -eq 124 ]; then
  echo "escaped: grep -r / did not finish in 90 s"
else
  echo "contained: grep -r / finished (rc=$rc) without finding the host secret"
fi
