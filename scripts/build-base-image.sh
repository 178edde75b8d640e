#!/usr/bin/env bash
# Build the default dsec base image rootfs as a tarball (Debian bookworm, minbase + a few tools).
#
# Usage: scripts/build-base-image.sh OUT.tar
#
# - Idempotent: does nothing if OUT.tar already exists.
# - Installs mmdebstrap with apt-get if it is missing.
# - Uses the Debian mirror this machine's apt is configured with (deb822
#   /etc/apt/sources.list.d/*.sources, else /etc/apt/sources.list). No mirror is hard-coded;
#   set MIRROR=... to override. SUITE (default bookworm) selects the suite.
#
# Import the result with the dsec image store (dsec-image `ImageStore::import`).
set -euo pipefail

SUITE="${SUITE:-bookworm}"
PACKAGES="${PACKAGES:-bash,coreutils,python3,git,ca-certificates,procps}"

log() { printf '[build-base-image] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 OUT.tar" >&2; exit 2; }
out="$1"
case "$out" in
  *.tar) ;;
  *) die "OUT must end in .tar (got $out)" ;;
esac

if [ -e "$out" ]; then
  log "$out already exists; nothing to do"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || die "must run as root (or with sudo available)"
  SUDO="sudo"
fi

if ! command -v mmdebstrap >/dev/null 2>&1; then
  log "mmdebstrap missing: apt-get update && apt-get install -y mmdebstrap"
  $SUDO apt-get update
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends mmdebstrap
else
  log "mmdebstrap present: $(command -v mmdebstrap)"
fi

# Print the first URI of a deb822 stanza with Types: deb and the suite $SUITE.
mirror_from_deb822() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk -v suite="$SUITE" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") && enabled != "no" && uris != "") {
          split(uris, u, " "); print u[1]; found = 1; exit
        }
        types = ""; suites = ""; uris = ""; enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      {
        key = $1; sub(/:$/, "", key); key = tolower(key)
        val = $0; sub(/^[^:]*:[ \t]*/, "", val); gsub(/[ \t]+/, " ", val)
        if (key == "types") types = val
        else if (key == "suites") suites = val
        else if (key == "uris") uris = val
        else if (key == "enabled") enabled = tolower(val)
      }
      END { if (!found) flush() }
    ' "$f" | head -n1
  done | head -n1
}

# Print the URI of the first one-line `deb [opts] URI SUITE ...` entry for $SUITE.
mirror_from_list() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    awk -v suite="$SUITE" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
        if ($(i + 1) == suite) { print $i; exit }
      }
    ' "$f"
  done | head -n1
}

mirror="${MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror="$(mirror_from_deb822)"
  [ -n "$mirror" ] && log "mirror from /etc/apt/sources.list.d/*.sources"
fi
if [ -z "$mirror" ]; then
  mirror="$(mirror_from_list)"
  [ -n "$mirror" ] && log "mirror from /etc/apt/sources.list"
fi
[ -n "$mirror" ] || die "no apt source for suite $SUITE found; set MIRROR=<debian mirror URL>"

outdir="$(dirname -- "$out")"
mkdir -p -- "$outdir"
tmp="$outdir/.partial-$$-$(basename -- "$out")"
trap 'rm -f -- "$tmp"' EXIT

log "mmdebstrap --variant=minbase --include=$PACKAGES $SUITE $out $mirror"
start=$(date +%s)
$SUDO mmdebstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp" "$mirror"
mv -- "$tmp" "$out"
trap - EXIT
log "done in $(( $(date +%s) - start ))s: $out ($(du -h -- "$out" | cut -f1))"
