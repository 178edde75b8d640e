# Shared setup for scripts/quickstart and scripts/test. Sourced, not run.
# Installs what dsec needs on a fresh Debian 12 machine, idempotently.

# Each line says how long the script has run, so a slow phase of a long job shows in its log.
log() { printf '\033[1m[dsec %ss]\033[0m %s\n' "$SECONDS" "$*" >&2; }
die() { log "error: $*"; exit 1; }

repo_root() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

# Debian packages: erofs-utils (mkfs.erofs), e2fsprogs (mkfs.ext4 for sandbox disks),
# python3-venv (the Python SDK's tests run in a venv), nftables (sandbox network policy),
# iproute2 (the network tests build a fake internet with `ip`),
# mmdebstrap (base image), the OCI runtimes the benchmark compares against, and
# protobuf-compiler and libprotobuf-dev (protoc and the well-known types its imports name,
# google/protobuf/descriptor.proto: the etcd client compiles etcd's .proto files when it
# builds; protoc alone fails on a machine that never had the headers).
APT_PACKAGES="erofs-utils e2fsprogs nftables iproute2 mmdebstrap crun runc python3 python3-venv ca-certificates protobuf-compiler libprotobuf-dev"
# What only the tests need: etcd-server (a real etcd for the state store and cluster tests),
# docker-registry (a real OCI registry for the pull tests; the tests start their own on
# loopback), skopeo (seeds it), apache2-utils (htpasswd, for its basic auth), openssl (the
# key pair and token signatures of its bearer-token auth) and faketime (a node whose clock
# is off).
TEST_APT_PACKAGES="etcd-server docker-registry skopeo apache2-utils openssl faketime chromium runsc qemu-system-x86 linux-image-cloud-amd64 cpio"

# Installs APT_PACKAGES and any packages named as arguments.
ensure_packages() {
  local missing=()
  for p in $APT_PACKAGES "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

ensure_root() {
  [ "$(id -u)" -eq 0 ] || die "run as root: dsec creates namespaces, mounts and cgroups"
}

# What a clean run of the whole suite takes on disk (build, base image, test state),
# measured from a fresh clone (about 4 GB at peak, plus the base image); see README.
SUITE_DISK_GB=10

# Says how much disk the build and the tests have, and warns when it is likely too
# little: a full disk shows up much later as a linker "Bus error" or failed writes.
report_free_disk() {
  local where free_gb
  for where in "$(repo_root)" "${TMPDIR:-/tmp}"; do
    free_gb=$(( $(df -Pk "$where" | awk 'NR==2{print $4}') / 1024 / 1024 ))
    log "free disk at $where: ${free_gb} GB"
    if [ "$free_gb" -lt "$SUITE_DISK_GB" ]; then
      log "warning: a clean run needs about ${SUITE_DISK_GB} GB free; expect failures"
    fi
  done
}

ensure_toolchain() {
  command -v cargo >/dev/null || die "cargo not found: install the Rust toolchain (rustup)"
}

# An S3-compatible server for the shared blob store tests: moto (PyPI) in its own venv.
S3_VENV="${DSEC_S3_VENV:-/tmp/dsec-s3}"
MOTO_VERSION="5.2.5"

ensure_s3_server() {
  if ! "$S3_VENV/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$MOTO_VERSION')" 2>/dev/null; then
    log "installing moto $MOTO_VERSION (S3 test server) into $S3_VENV"
    python3 -m venv "$S3_VENV"
    "$S3_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION"
  fi
  export DSEC_S3_SERVER="$S3_VENV/bin/moto_server"
}

# The default base image rootfs tarball (cached across runs).
BASE_TAR="${DSEC_BASE_TAR:-/var/cache/dsec/base-bookworm.tar}"

ensure_base_tar() {
  mkdir -p "$(dirname "$BASE_TAR")"
  "$(repo_root)/scripts/build-base-image.sh" "$BASE_TAR"
}

# The base image plus C and C++ compilers: function-call tests and benchmarks compile
# code in it (SandboxFusion's cpp).
CPP_TAR="${DSEC_CPP_TAR:-/var/cache/dsec/cpp-bookworm.tar}"
ensure_cpp_tar() {
  mkdir -p "$(dirname "$CPP_TAR")"
  PACKAGES="bash,coreutils,python3,git,ca-certificates,procps,g++,gcc,libc6-dev" \
    "$(repo_root)/scripts/build-base-image.sh" "$CPP_TAR"
}

# A Debian image with systemd for isolation `vm` (a full machine boots its own init):
# the VM test boots it, and `dsec image import` makes it a user's VM image.
VM_TAR="${DSEC_VM_TAR:-/var/cache/dsec/vm-bookworm.tar}"
ensure_vm_tar() {
  mkdir -p "$(dirname "$VM_TAR")"
  PACKAGES="bash,coreutils,systemd-sysv,udev,procps" \
    "$(repo_root)/scripts/build-base-image.sh" "$VM_TAR"
}

# Builds the in-sandbox agent as a static binary (glibc, no extra toolchain), and not
# position-independent: a static-pie agent applied ~6700 relocations at every sandbox
# start, which cost ~0.15 ms and left ~100 KiB of private dirty pages in each sandbox. The
# agent runs with the same uid, capabilities and seccomp policy as the code it serves (and
# is not dumpable), so the ASLR of its own image protects little.
STATIC_AGENT_TARGET="x86_64-unknown-linux-gnu"
static_agent_path() { echo "$(repo_root)/target/$STATIC_AGENT_TARGET/release/dsec-agent"; }

build_static_agent() {
  log "building the static dsec-agent"
  (cd "$(repo_root)" && RUSTFLAGS="-C target-feature=+crt-static -C relocation-model=static" \
    cargo build --release --locked -p dsec-agent --target "$STATIC_AGENT_TARGET")
  file "$(static_agent_path)" 2>/dev/null | grep -q "static" || log "warning: agent is not static"
}
