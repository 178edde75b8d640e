# /proc: kernel memory, kernel settings, other sandboxes' processes.
if [ -s /proc/kcore ] && head -c 16 /proc/kcore 2>/dev/null | grep -q .; then
  echo "escaped: /proc/kcore readable"
else
  echo "contained: /proc/kcore empty or unreadable"
fi
if echo 1 > /proc/sys/kernel/sysrq 2>/dev/null; then
  echo "escaped: wrote /proc/sys/kernel/sysrq"
else
  echo "contained: /proc/sys is read-only"
fi
if echo c > /proc/sysrq-trigger 2>/dev/null; then
  echo "escaped: wrote /proc/sysrq-trigger"
else
  echo "contained: /proc/sysrq-trigger not writable"
fi
python3 -c 'import sys; print(sys.argv[1][::-1])' "$NEIGHBOUR_MARK_REV" > /tmp/mark
if grep -qsF -f /tmp/mark /proc/[0-9]*/cmdline; then
  echo "escaped: the neighbour's process is visible"
else
  echo "contained: no process of the neighbour in /proc ($(ls -d /proc/[0-9]* | wc -l) pids visible)"
fi
