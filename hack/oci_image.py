#!/usr/bin/env python3
"""Write OCI image layouts (image-spec v1.1) from root filesystem trees, with the standard
library and GNU tar only: used by hack/lib-images.sh, which builds dynsnap's images from Debian
packages where no base-image registry (and no image builder) is reachable.

    oci_image.py layer --rootfs DIR [--files-from LIST] --out LAYER.json
        one gzip layer of DIR (or of the paths in LIST, relative to DIR, one per line, directories
        not recursed), written as LAYER.json's sibling blob file; LAYER.json holds its descriptor
        and diff_id (the digest of the uncompressed tar, which the image config lists)
    oci_image.py image --layout OUT --spec SPEC.json LAYER.json...
        an image layout at OUT: oci-layout, index.json (one manifest, its tag in
        org.opencontainers.image.ref.name), the manifest, the config and the layers (hard links to
        the layer blobs when on the same file system)

SPEC.json: {"name": ..., "tag": ..., "created": RFC 3339,
            "config": {"Entrypoint": [...], "Cmd": [...], "Env": [...], "User": "uid:gid",
                       "WorkingDir": "/", "Labels": {...}},
            "history": ["what made layer 1", ...]}

Layers keep numeric owners, modes and mtimes (the bytecode in them records its source's mtime),
entries sorted by name. ``skopeo copy oci:OUT:TAG docker://REGISTRY/NAME:TAG`` pushes a layout;
``tar -C OUT -cf IMAGE.tar .`` makes the archive ``podman load`` and ``ctr image import`` read.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CHUNK = 1 << 20


def _arch() -> str:
    """The OCI (Go) name of this machine's architecture: the binaries in the images are built here."""
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


class _HashingWriter:
    """A file that also hashes what is written to it (the compressed layer's digest)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, b: bytes) -> int:
        self.sha.update(b)
        n: int = self.f.write(b)
        return n

    def flush(self) -> None:
        self.f.flush()


def layer(rootfs: Path, out: Path, files_from: Path | None) -> dict[str, Any]:
    argv = ["tar", "--sort=name", "--numeric-owner", "--one-file-system", "-C", str(rootfs), "-cf", "-"]
    argv += ["--no-recursion", "-T", str(files_from)] if files_from else ["."]
    tmp = out.with_suffix(".blob.tmp")
    raw = hashlib.sha256()
    tar = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert tar.stdout is not None
    with open(tmp, "wb") as f:
        hw = _HashingWriter(f)
        # No name and mtime 0 in the gzip header: only the content decides the digest.
        with gzip.GzipFile(filename="", mode="wb", fileobj=hw, compresslevel=6, mtime=0) as gz:  # type: ignore[arg-type]
            while chunk := tar.stdout.read(CHUNK):
                raw.update(chunk)
                gz.write(chunk)
    if tar.wait() != 0:
        tmp.unlink()
        raise SystemExit(f"oci_image.py: tar of {rootfs} failed (exit {tar.returncode})")
    digest = hw.sha.hexdigest()
    blob = out.parent / f"{out.stem}.{digest[:12]}.blob"
    tmp.rename(blob)
    desc = {"mediaType": MT_LAYER, "digest": f"sha256:{digest}", "size": blob.stat().st_size,
            "diff_id": f"sha256:{raw.hexdigest()}", "blob": blob.name}
    out.write_text(json.dumps(desc, indent=1) + "\n")
    return desc


def _put(blobs: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def image(layout: Path, spec: dict[str, Any], layer_files: list[Path]) -> dict[str, Any]:
    if layout.exists():
        shutil.rmtree(layout)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layers = [json.loads(p.read_text()) | {"_path": p.parent / json.loads(p.read_text())["blob"]}
              for p in layer_files]
    for lay in layers:
        dest = blobs / lay["digest"].split(":", 1)[1]
        try:
            os.link(lay["_path"], dest)  # the cached layer is immutable: share its bytes
        except OSError:
            shutil.copyfile(lay["_path"], dest)
    created = spec["created"]
    history = spec.get("history") or []
    config = {
        "created": created, "architecture": _arch(), "os": "linux", "config": spec["config"],
        "rootfs": {"type": "layers", "diff_ids": [lay["diff_id"] for lay in layers]},
        "history": [{"created": created, "created_by": history[i] if i < len(history) else "hack/oci_image.py"}
                    for i in range(len(layers))],
    }
    cfg = {"mediaType": MT_CONFIG, **_put(blobs, json.dumps(config, indent=1, sort_keys=True).encode())}
    manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST, "config": cfg,
                "layers": [{k: lay[k] for k in ("mediaType", "digest", "size")} for lay in layers],
                "annotations": {"org.opencontainers.image.created": created}}
    man = _put(blobs, json.dumps(manifest, indent=1, sort_keys=True).encode())
    index = {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [{
        "mediaType": MT_MANIFEST, **man, "platform": {"architecture": _arch(), "os": "linux"},
        # ref.name is the tag (skopeo's oci:DIR:TAG); containerd's import reads the full name.
        "annotations": {"org.opencontainers.image.ref.name": spec["tag"],
                        "io.containerd.image.name": f"{spec['name']}:{spec['tag']}"}}]}
    (layout / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}) + "\n")
    return {"name": spec["name"], "tag": spec["tag"], "manifest": man["digest"],
            "compressed_bytes": sum(lay["size"] for lay in layers)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("layer")
    la.add_argument("--rootfs", type=Path, required=True)
    la.add_argument("--files-from", type=Path)
    la.add_argument("--out", type=Path, required=True)
    im = sub.add_parser("image")
    im.add_argument("--layout", type=Path, required=True)
    im.add_argument("--spec", type=Path, required=True)
    im.add_argument("layers", type=Path, nargs="+")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("oci_image.py: run as root (the trees hold root-only files it must read)", file=sys.stderr)
        return 1
    if a.cmd == "layer":
        print(json.dumps(layer(a.rootfs, a.out, a.files_from)))
    else:
        print(json.dumps(image(a.layout, json.loads(a.spec.read_text()), a.layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
