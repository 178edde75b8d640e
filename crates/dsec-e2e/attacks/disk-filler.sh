# Disk filler: write until the disk is full; the sandbox's own disk fills, not the host's.
# dd's complaint is kept in memory: a file for it would be on the disk it fills.
err=$(dd if=/dev/zero of=/fill bs=1M count=4096 2>&1)
rc=$?
size=$(wc -c < /fill)
if printf '%s' "$err" | grep -q "No space left" && [ "$size" -lt $((600 << 20)) ]; then
  echo "contained: ENOSPC after $((size >> 20)) MiB (disk 512 MiB)"
else
  echo "escaped: wrote $((size >> 20)) MiB (rc=$rc: $(printf '%s' "$err" | tail -c 200 | tr '\n' ' '))"
fi
rm -f /fill
echo ok > /tmp/after-fill && echo "contained: disk usable again after removing the file"
