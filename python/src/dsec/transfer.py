"""Directory transfer helpers: a local tree as a tar archive, and safe extraction of one."""

from __future__ import annotations

import io
import os
import tarfile

__all__ = ["tar_directory", "extract_tar"]


def tar_directory(local_dir: str) -> bytes:
    """The contents of ``local_dir`` as an uncompressed tar (paths relative to it; symlinks
    kept as links, not followed)."""
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(f"{local_dir} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(local_dir)):
            tar.add(os.path.join(local_dir, entry), arcname=entry, recursive=True)
    return buf.getvalue()


def _check_member(m: tarfile.TarInfo, dest: str) -> None:
    target = os.path.realpath(os.path.join(dest, m.name))
    if not (target == dest or target.startswith(dest + os.sep)):
        raise ValueError(f"archive member {m.name!r} leaves {dest}")
    if m.isdev():
        raise ValueError(f"archive member {m.name!r} is a device node")
    if m.islnk() or m.issym():
        base = dest if m.islnk() else os.path.dirname(target)
        link = os.path.realpath(os.path.join(base, m.linkname))
        if not (link == dest or link.startswith(dest + os.sep)):
            raise ValueError(f"archive member {m.name!r} links outside {dest}")


def extract_tar(data: bytes, local_dir: str) -> None:
    """Extracts the tar ``data`` into ``local_dir`` (created if missing). Members that
    would land or link outside it, and device nodes, are refused before anything is
    written; setuid bits are dropped."""
    os.makedirs(local_dir, exist_ok=True)
    dest = os.path.realpath(local_dir)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        for m in members:
            _check_member(m, dest)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: the checks above, and no special bits
            for m in members:
                m.mode &= 0o777
            tar.extractall(dest, members=members)  # noqa: S202 (checked above)
