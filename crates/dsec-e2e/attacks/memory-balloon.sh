# Memory balloon: allocate 1 GiB in a 256 MiB sandbox; the allocator dies, not the host.
python3 -c '
chunks = []
for _ in range(1024):
    chunks.append(bytearray(1 << 20))
print("allocated")
' >/tmp/balloon.out 2>&1
rc=$?
if grep -q allocated /tmp/balloon.out; then
  echo "escaped: 1 GiB allocated in a 256 MiB sandbox"
else
  echo "contained: balloon killed (rc=$rc)"
fi
