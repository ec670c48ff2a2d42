"""deploy/images/*/Containerfile, the build files for registries people use (no base-image registry is
reachable here, so they are read, not built; hack/lib-images.sh builds the same images locally and
tests/integration/test_images.py checks those): they must make what the local build makes.

- the agent's CRIU carries dynsnap's patches, every hack/patches/criu/*.patch in order, applied to the
  orig tarball hack/lib-criu.sh checks, before CRIU is built (a stock CRIU restores huge-page memory onto
  4 KiB pages and reads a snapshot's pages with one thread: docs/CRIU_PATCHES.md);
- the entrypoint image holds every file the examples' init containers copy out of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"


def _instructions(path: Path) -> list[str]:
    """The Containerfile's instructions, continuation lines joined, comments dropped."""
    out: list[str] = []
    cur = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        cur += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if cur.strip():
                out.append(cur.strip())
            cur = ""
    return out


def _stage(instructions: list[str], name: str) -> list[str]:
    start = next(i for i, ins in enumerate(instructions) if re.match(rf"FROM \S+ AS {name}$", ins))
    end = next((i for i in range(start + 1, len(instructions)) if instructions[i].startswith("FROM ")),
               len(instructions))
    return instructions[start:end]


def test_agent_containerfile_builds_criu_with_every_dynsnap_patch_in_order() -> None:
    criu = _stage(_instructions(IMAGES / "agent" / "Containerfile"), "criu")
    copy = next(i for i, ins in enumerate(criu) if ins.startswith("COPY hack/patches/criu "))
    dest = criu[copy].split()[-1]
    apply = next(i for i, ins in enumerate(criu) if "patch -p1" in ins)
    build = next(i for i, ins in enumerate(criu) if ins.startswith("RUN make") and "criu" in ins)
    unpack = next(i for i, ins in enumerate(criu) if "tar -xf" in ins)
    assert unpack < copy < apply < build, criu  # onto the unpacked tarball, before the build
    # Every patch of the directory, in the glob's (name) order, which is hack/lib-criu.sh's, failing the build
    # when one does not apply.
    assert f"for p in {dest}/*.patch" in criu[apply] and "|| exit 1" in criu[apply], criu[apply]
    assert sorted(p.name for p in (ROOT / "hack" / "patches" / "criu").glob("*.patch")), "no patches?"
    assert re.search(r"\bpatch\b", next(ins for ins in criu if "apt-get install" in ins)), "patch is not installed"


def test_agent_containerfile_fetches_the_criu_the_local_build_checks() -> None:
    text = (IMAGES / "agent" / "Containerfile").read_text()
    versions = dict(line.split("#")[0].strip().split("=", 1) for line in (ROOT / "hack" / "versions.env").read_text()
                    .splitlines() if "=" in line.split("#")[0])
    assert f"ARG CRIU_VERSION={versions['CRIU_VERSION']}" in text
    sha = re.search(r'CRIU_ORIG_SHA256:-([0-9a-f]{64})', (ROOT / "hack" / "lib-criu.sh").read_text())
    assert sha is not None and f"ARG CRIU_SHA256={sha.group(1)}" in text
    assert f"criu_{versions['CRIU_VERSION']}.orig.tar.xz" in text


def _init_copies() -> set[str]:
    """The files the examples' init containers copy out of the entrypoint image (``cp SRC DST``)."""
    out = set()
    for example in sorted((ROOT / "examples" / "dgd").glob("*.yaml")):
        for comp in yaml.safe_load(example.read_text())["spec"]["components"]:
            for init in comp["podTemplate"]["spec"].get("initContainers") or []:
                cmd = init["command"]
                assert cmd[0] == "cp" and len(cmd) == 3, (example.name, init)
                out.add(cmd[1])
    return out


def test_entrypoint_containerfile_holds_every_file_the_examples_copy_out() -> None:
    ins = _instructions(IMAGES / "entrypoint" / "Containerfile")
    final = ins[max(i for i, x in enumerate(ins) if x.startswith("FROM ")):]
    copied = {x.split()[-1] for x in final if x.startswith("COPY --from=build")}
    want = _init_copies()
    assert want == {"/usr/local/bin/dynsnap-entrypoint", "/usr/local/bin/libdynsnap-thp.so"}, want
    assert want <= copied, want - copied
    build = _stage(ins, "build")
    made = next(x for x in build if x.startswith("RUN make -C native"))
    assert "entrypoint" in made.split() and "thp" in made.split(), made
    assert "COPY native/thp native/thp" in build
