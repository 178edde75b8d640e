#!/usr/bin/env python3
"""Writes the seed inputs of the cargo fuzz targets into fuzz/seeds/TARGET/ (checked in).

Each seed is small and valid, so libFuzzer starts from real structure: agent frames and
JSON messages, tars with every entry kind the importers handle, a `docker save` archive and
an OCI layout whose digests all match. Run again after changing it: the output is
reproducible (fixed mtimes, owners and gzip headers).
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = os.path.join(HERE, "seeds")
MTIME = 1_700_000_000


def write(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- frame_decode: the first byte picks where the stream is cut in two ----------------

def frame(tag, payload):
    return struct.pack(">IB", len(payload) + 1, tag) + payload


def frames():
    j = lambda v: frame(0, json.dumps(v, separators=(",", ":")).encode())
    write("frame_decode", "ping", b"\x03" + j({"op": "ping"}))
    write("frame_decode", "exec", b"\x07" + j({
        "op": "exec", "cmd": ["sh", "-c", "echo hi"], "env": {"A": "1"}, "cwd": "/tmp",
        "stdin": True, "timeout_ms": 1000, "stream": True, "user": "1000:1000"})
        + frame(3, b"input") + frame(4, b""))
    write("frame_decode", "output", b"\x02" + j({"reply": "started", "pid": 7})
          + frame(1, b"out\n") + frame(2, b"err\xff") + frame(3, bytes(range(64)))
          + j({"reply": "exited", "exit_code": 0, "signal": None, "duration_ms": 3,
               "timed_out": False, "stdout_bytes": 4, "stderr_bytes": 4,
               "stdout_truncated": False, "stderr_truncated": False}) + frame(4, b""))
    write("frame_decode", "pong", b"\x00" + j({"reply": "pong", "version": 9, "pid": 1}))
    write("frame_decode", "error", b"\x00" + j({
        "reply": "error", "code": "not_found", "message": "no such file"}))
    write("frame_decode", "entries", b"\x00" + j({"reply": "entries", "entries": [{
        "name": "a", "path": "/a", "kind": "symlink", "size": 1, "mode": 511,
        "mtime": 0, "uid": 0, "gid": 0, "symlink_target": "b"}]}))


# ---- tars -----------------------------------------------------------------------------

def info(name, kind=tarfile.REGTYPE, mode=0o644, **kw):
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime = kind, mode, MTIME
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def make_tar(entries, fmt=tarfile.PAX_FORMAT):
    """entries: (TarInfo, bytes or None)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for ti, data in entries:
            if data is not None:
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
            else:
                t.addfile(ti)
    # Without the padding to a 10 KiB record: the last block, then the two zero blocks
    # of the end-of-archive marker.
    data = buf.getvalue().rstrip(b"\0")
    return data + b"\0" * (-len(data) % 512 + 1024)


def gz(data):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:
        g.write(data)
    return buf.getvalue()


def rootfs_entries():
    return [
        (info("./", tarfile.DIRTYPE, 0o755), None),
        (info("etc/", tarfile.DIRTYPE, 0o755), None),
        (info("etc/hostname"), b"sandbox\n"),
        (info("etc/link", tarfile.SYMTYPE, 0o777, linkname="hostname"), None),
        (info("etc/hard", tarfile.LNKTYPE, linkname="etc/hostname"), None),
        (info("bin/", tarfile.DIRTYPE, 0o755), None),
        (info("bin/su", mode=0o4755, uid=0, gid=0), b"#!/bin/sh\n"),
        (info("run/fifo", tarfile.FIFOTYPE, 0o600), None),
        (info("dev/null", tarfile.CHRTYPE, 0o666, devmajor=1, devminor=3), None),
        (info("home/user/", tarfile.DIRTYPE, 0o700, uid=1000, gid=1000), None),
    ]


def tars():
    entries = rootfs_entries()
    write("tar_import", "rootfs.tar", make_tar(entries))
    write("tar_import", "rootfs-gnu.tar", make_tar(entries, tarfile.GNU_FORMAT))
    write("tar_import", "rootfs.tar.gz", gz(make_tar(entries)))
    # PAX records: an xattr and a path longer than the ustar name field.
    xattr = info("opt/cap", pax_headers={"SCHILY.xattr.user.mime": "text/plain"})
    long = info("opt/" + "d" * 90 + "/" + "f" * 90)
    write("tar_import", "pax.tar", make_tar([
        (info("opt/", tarfile.DIRTYPE, 0o755), None), (xattr, b"x"), (long, b"long\n")]))
    if shutil.which("zstd"):
        z = subprocess.run(["zstd", "-q", "-c", "-3"], input=make_tar(entries[:5]),
                           check=True, capture_output=True).stdout
        write("tar_import", "rootfs.tar.zst", z)


# ---- images: docker save and OCI layout -------------------------------------------------

def sha(b):
    return hashlib.sha256(b).hexdigest()


def layers():
    base = make_tar([
        (info("etc/", tarfile.DIRTYPE, 0o755), None),
        (info("etc/os-release"), b"ID=seed\n"),
        (info("etc/gone"), b"old\n"),
        (info("var/", tarfile.DIRTYPE, 0o755), None),
        (info("var/cache/", tarfile.DIRTYPE, 0o755), None),
        (info("var/cache/old"), b"old\n"),
        (info("bin/", tarfile.DIRTYPE, 0o755), None),
        (info("bin/sh"), b"#!sh\n"),
        (info("bin/bash", tarfile.LNKTYPE, linkname="bin/sh"), None),
        (info("usr/", tarfile.DIRTYPE, 0o755), None),
        (info("usr/sh", tarfile.SYMTYPE, 0o777, linkname="../bin/sh"), None),
    ])
    top = make_tar([
        (info("etc/", tarfile.DIRTYPE, 0o755), None),
        (info("etc/.wh.gone", mode=0), b""),
        (info("var/cache/", tarfile.DIRTYPE, 0o755), None),
        (info("var/cache/.wh..wh..opq", mode=0), b""),
        (info("var/cache/new"), b"new\n"),
        (info("etc/app.conf", pax_headers={"SCHILY.xattr.user.k": "v"}), b"k=v\n"),
    ])
    return base, top


def config(diff_ids):
    return json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["sh"], "WorkingDir": "/",
                   "User": "0"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + d for d in diff_ids]},
    }).encode()


def docker_save():
    base, top = layers()
    cfg = config([sha(base), sha(top)])
    manifest = json.dumps([{"Config": "config.json", "RepoTags": ["seed:1"],
                            "Layers": ["base/layer.tar", "top/layer.tar"]}]).encode()
    return make_tar([
        (info("base/", tarfile.DIRTYPE, 0o755), None),
        (info("base/layer.tar"), base),
        (info("top/", tarfile.DIRTYPE, 0o755), None),
        (info("top/layer.tar"), top),
        (info("config.json"), cfg),
        (info("manifest.json"), manifest),
    ], tarfile.USTAR_FORMAT)


def oci_layout():
    base, top = layers()
    top_gz = gz(top)
    cfg = config([sha(base), sha(top)])
    blob = lambda media, b: {"mediaType": media, "digest": "sha256:" + sha(b), "size": len(b)}
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob("application/vnd.oci.image.config.v1+json", cfg),
        "layers": [blob("application/vnd.oci.image.layer.v1.tar", base),
                   blob("application/vnd.oci.image.layer.v1.tar+gzip", top_gz)],
    }).encode()
    m = blob("application/vnd.oci.image.manifest.v1+json", manifest)
    m["platform"] = {"architecture": "amd64", "os": "linux"}
    index = json.dumps({"schemaVersion": 2, "manifests": [m]}).encode()
    blobs = [(info("blobs/sha256/" + sha(b)), b) for b in (base, top_gz, cfg, manifest)]
    return make_tar([
        (info("oci-layout"), b'{"imageLayoutVersion":"1.0.0"}'),
        (info("index.json"), index),
        (info("blobs/", tarfile.DIRTYPE, 0o755), None),
        (info("blobs/sha256/", tarfile.DIRTYPE, 0o755), None),
        *blobs,
        # Docker 25+ names the layers in manifest.json too; a symlink to a blob here.
        (info("layer.tar", tarfile.SYMTYPE, 0o777, linkname="blobs/sha256/" + sha(base)),
         None),
    ], tarfile.USTAR_FORMAT)


def images():
    write("oci_import", "docker-save.tar", docker_save())
    write("oci_import", "oci-layout.tar", oci_layout())


# ---- agent_tar_upload: what a `PUT files/tar` body holds ---------------------------------

def uploads():
    write("agent_tar_upload", "tree.tar", make_tar([
        (info("src/", tarfile.DIRTYPE, 0o755), None),
        (info("src/main.py", mode=0o755), b"print('hi')\n"),
        (info("src/link", tarfile.SYMTYPE, 0o777, linkname="main.py"), None),
        (info("src/hard", tarfile.LNKTYPE, linkname="src/main.py"), None),
        (info("data/", tarfile.DIRTYPE, 0o700), None),
        (info("data/x.bin"), bytes(range(256))),
        (info("existing", tarfile.LNKTYPE, linkname="keep/old.txt"), None),
    ]))
    write("agent_tar_upload", "overwrite.tar", make_tar([
        (info("keep/", tarfile.DIRTYPE, 0o750), None),
        (info("keep/old.txt"), b"replaced\n"),
        (info("keep/sub/deep/file"), b"deep\n"),
    ], tarfile.GNU_FORMAT))


# ---- regressions: inputs that escaped the destination once (see docs/fuzzing.md) --------

REGRESSIONS = os.path.join(HERE, "regressions")


def regressions():
    def put(target, name, data):
        d = os.path.join(REGRESSIONS, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

    # A FIFO below a symlink out of the tree: its parents were made outside.
    put("tar_import", "fifo-mkdir-outside.tar", make_tar([
        (info("s", tarfile.SYMTYPE, 0o777, linkname="../outside"), None),
        (info("s/x/y/f", tarfile.FIFOTYPE, 0o600), None),
    ], tarfile.USTAR_FORMAT))
    # An implicit directory replaced by a symlink out of the tree: chmodded 0755 through it.
    layer = make_tar([
        (info("a/b"), b""),
        (info("a", tarfile.SYMTYPE, 0o777, linkname="../outside/dir"), None),
    ], tarfile.USTAR_FORMAT)
    manifest = json.dumps([{"Config": "config.json", "Layers": ["l/layer.tar"]}]).encode()
    put("oci_import", "implicit-dir-chmod.tar", make_tar([
        (info("l/layer.tar"), layer),
        (info("config.json"), config([sha(layer)])),
        (info("manifest.json"), manifest),
    ], tarfile.USTAR_FORMAT))


if __name__ == "__main__":
    shutil.rmtree(SEEDS, ignore_errors=True)
    shutil.rmtree(REGRESSIONS, ignore_errors=True)
    regressions()
    frames()
    tars()
    images()
    uploads()
