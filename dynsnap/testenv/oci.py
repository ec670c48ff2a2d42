"""dynsnap's images read back as OCI image layouts (index, manifest, config, layer blobs, each checked
against its digest): what tests/integration/test_images.py asserts of them, and what test_real_node_wake.py compares the
files the chart's pods put on the real node with. Running them
is kubelet's and containerd's job on the real node (the crun-run containers that stood in for it are
gone).

Layer: ``dynsnap.testenv``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def image_layout(name: str) -> Path:
    """The OCI layout of one of dynsnap's images as setup built it (``$DYNSNAP_IMAGES/<name>``)."""
    root = os.environ.get("DYNSNAP_IMAGES")
    if not root or not (Path(root) / ".complete").is_file():
        raise FileNotFoundError("DYNSNAP_IMAGES is not set or not complete; run `./run setup` (hack/lib-images.sh)")
    return Path(root) / name


def _sha256_file(path: Path, *, gunzip: bool = False) -> str:
    h = hashlib.sha256()
    with (gzip.open(path, "rb") if gunzip else open(path, "rb")) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


@dataclass(frozen=True)
class OciImage:
    """One image of an OCI image layout (its index names exactly one manifest)."""

    layout: Path
    index: dict[str, Any]
    manifest: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def load(cls, layout: Path) -> OciImage:
        index = json.loads((layout / "index.json").read_text())
        if len(index["manifests"]) != 1:
            raise ValueError(f"{layout}: expected one manifest, found {len(index['manifests'])}")
        manifest = json.loads(cls._blob_path(layout, index["manifests"][0]["digest"]).read_text())
        config = json.loads(cls._blob_path(layout, manifest["config"]["digest"]).read_text())
        return cls(layout, index, manifest, config)

    @staticmethod
    def _blob_path(layout: Path, digest: str) -> Path:
        algo, hexd = digest.split(":", 1)
        return layout / "blobs" / algo / hexd

    @property
    def ref_name(self) -> str:
        return str(self.index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"])

    @property
    def image_config(self) -> dict[str, Any]:
        return dict(self.config.get("config") or {})

    @property
    def entrypoint(self) -> list[str]:
        return list(self.image_config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self.image_config.get("Cmd") or [])

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.image_config.get("Env") or [])

    @property
    def user(self) -> tuple[int, int]:
        """The numeric uid:gid the image runs as (dynsnap's images name numbers, not names)."""
        u = str(self.image_config.get("User") or "0:0")
        uid, _, gid = u.partition(":")
        return int(uid), int(gid or uid)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.image_config.get("Labels") or {})

    def layer_paths(self) -> list[Path]:
        return [self._blob_path(self.layout, lay["digest"]) for lay in self.manifest["layers"]]

    def verify(self) -> None:
        """Every blob's bytes match its digest and size, and each layer's uncompressed bytes match
        the config's diff_id (what a registry or a runtime checks before trusting an image)."""
        man_desc = self.index["manifests"][0]
        for desc in [man_desc, self.manifest["config"], *self.manifest["layers"]]:
            p = self._blob_path(self.layout, desc["digest"])
            if _sha256_file(p) != desc["digest"] or p.stat().st_size != desc["size"]:
                raise ValueError(f"{p}: bytes do not match descriptor {desc['digest']} ({desc['size']} bytes)")
        diff_ids = self.config["rootfs"]["diff_ids"]
        if len(diff_ids) != len(self.manifest["layers"]):
            raise ValueError(f"{self.layout}: {len(diff_ids)} diff_ids for {len(self.manifest['layers'])} layers")
        for p, diff_id in zip(self.layer_paths(), diff_ids, strict=True):
            if _sha256_file(p, gunzip=True) != diff_id:
                raise ValueError(f"{p}: uncompressed bytes do not match diff_id {diff_id}")

    def members(self) -> Iterator[tarfile.TarInfo]:
        """Every entry of every layer, lowest layer first (later entries of a path win)."""
        for p in self.layer_paths():
            with tarfile.open(p, "r:gz") as tf:
                yield from tf

    def files(self) -> dict[str, tarfile.TarInfo]:
        """The image's file system as the runtime sees it: path (no leading ./) -> its top entry."""
        out: dict[str, tarfile.TarInfo] = {}
        for m in self.members():
            name = m.name[2:] if m.name.startswith("./") else m.name
            if os.path.basename(name).startswith(".wh."):
                raise ValueError(f"{self.layout}: whiteout {name}: dynsnap's images never delete in a layer")
            out[name.rstrip("/") or "."] = m
        return out

    def read(self, path: str) -> bytes:
        """The bytes of a regular file of the image (its top layer's copy)."""
        data: bytes | None = None
        for p in self.layer_paths():
            with tarfile.open(p, "r:gz") as tf:
                for m in tf:
                    if m.name in (f"./{path}", path) and m.isfile():
                        f = tf.extractfile(m)
                        assert f is not None
                        data = f.read()
        if data is None:
            raise FileNotFoundError(f"{path} is not a regular file in {self.layout}")
        return data
