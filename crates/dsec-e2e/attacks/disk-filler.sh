# Disk filler: write until the disk is full; the sandbox's own disk fills, not the host's.
dd if=/dev/zero of=/fill bs=1M count=4096 2>/tmp/dd.err
rc=$?
size=$(wc -c < /fill)
if grep -q "No space left" /tmp/dd.err && [ "$size" -lt $((600 << 20)) ]; then
  echo "contained: ENOSPC after $((size >> 20)) MiB (disk 512 MiB)"
else
  echo "escaped: wrote $((size >> 20)) MiB (rc=$rc)"
fi
rm -f /fill
echo ok > /tmp/after-fill && echo "contained: disk usable again after removing the file"
