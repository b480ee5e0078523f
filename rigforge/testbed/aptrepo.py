"""Local signed apt repositories holding the simulated NVIDIA packages.

Two flat repositories (`Suites: /`, like NVIDIA's CUDA and libnvidia-container repos), each signed with one
throwaway gpg key (InRelease clearsigned + detached Release.gpg), its armored public key served beside it:

    <root>/cuda/                  nvidia-driver-580-open, nvidia-driver-580   key: cuda/3bf863cc.pub
    <root>/libnvidia-container/   nvidia-container-toolkit                    key: libnvidia-container/gpgkey

Built once per testbed dir; the cache key is the hash of the stub sources and this file.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from ._util import ensure_safe_dir, hash_tree, log, sh

STUBS = Path(__file__).parent / "stubs"
DRIVER_VERSION = "580.159.04"
DRIVER_DEB_VERSION = f"{DRIVER_VERSION}-1"
TOOLKIT_VERSION = "1.17.8"
TOOLKIT_DEB_VERSION = f"{TOOLKIT_VERSION}-1"
DRIVER_REPO, DRIVER_KEY = "cuda", "cuda/3bf863cc.pub"
TOOLKIT_REPO, TOOLKIT_KEY = "libnvidia-container", "libnvidia-container/gpgkey"

DRIVER_POSTINST = """#!/bin/sh
# rigforge testbed: simulate the freshly loaded kernel module (in a chroot /sys and /proc are plain dirs)
set -e
if [ "$1" = configure ]; then
    mkdir -p /sys/module/nvidia /proc/driver/nvidia
    echo "{version}" > /sys/module/nvidia/version
    printf 'NVRM version: NVIDIA UNIX {kind} Kernel Module for x86_64  %s  Release Build  (rigforge@testbed)\\n' \\
        "{version}" > /proc/driver/nvidia/version
fi
exit 0
"""


def repo_key() -> str:
    return hash_tree(STUBS, Path(__file__))


def _control(name: str, version: str, description: str, **extra: str) -> str:
    fields = {
        "Package": name,
        "Version": version,
        "Architecture": "all",
        "Maintainer": "rigforge testbed <testbed@rigforge.invalid>",
        "Depends": "python3",
        **extra,
        "Description": f"{description}\n rigforge testbed stub: simulated hardware, no GPU behind it.",
    }
    return "".join(f"{k}: {v}\n" for k, v in fields.items())


def _stub(name: str, **subst: str) -> str:
    text = (STUBS / name).read_text()
    for key, value in subst.items():
        text = text.replace(f"@{key}@", value)
    return text


def _build_deb(work: Path, out_dir: Path, control: str, files: dict[str, str], postinst: str | None = None):
    name = control.split("\n", 1)[0].split(": ", 1)[1]
    pkg = work / name
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(control)
    if postinst:
        (pkg / "DEBIAN/postinst").write_text(postinst)
        (pkg / "DEBIAN/postinst").chmod(0o755)
    for path, text in files.items():
        target = pkg / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(0o755)
    sh(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(pkg), str(out_dir)], capture=True)


def _index_and_sign(repo: Path, gnupghome: Path) -> None:
    packages = sh(["apt-ftparchive", "packages", "."], cwd=repo, capture=True).stdout
    (repo / "Packages").write_text(packages)
    sh(["gzip", "-9kf", "Packages"], cwd=repo)
    release = sh(
        ["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=rigforge-testbed", "release", "."],
        cwd=repo,
        capture=True,
    ).stdout
    (repo / "Release").write_text(release)
    gpg = ["gpg", "--homedir", str(gnupghome), "--batch", "--yes", "--digest-algo", "SHA512"]
    sh([*gpg, "--clearsign", "-o", str(repo / "InRelease"), str(repo / "Release")], capture=True)
    sh([*gpg, "--armor", "--detach-sign", "-o", str(repo / "Release.gpg"), str(repo / "Release")], capture=True)


def build(testbed_dir: Path) -> Path:
    """Return the root directory of the signed repositories, building it if the stubs changed."""
    cache = ensure_safe_dir(Path(testbed_dir) / "cache")
    root = cache / f"apt-{repo_key()}"
    if (root / ".ready").exists():
        return root
    t0 = time.monotonic()
    for old in cache.glob("apt-*"):  # earlier stub versions
        shutil.rmtree(old)
    driver_repo, toolkit_repo = root / DRIVER_REPO, root / TOOLKIT_REPO
    driver_repo.mkdir(parents=True)
    toolkit_repo.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rigforge-apt-") as tmp:
        tmp = Path(tmp)
        for flavor, name, other, kind in (
            ("open", "nvidia-driver-580-open", "nvidia-driver-580", "Open"),
            ("proprietary", "nvidia-driver-580", "nvidia-driver-580-open", "Proprietary"),
        ):
            subst = {"DRIVER_VERSION": DRIVER_VERSION, "FLAVOR": flavor}
            _build_deb(
                tmp / "build",
                driver_repo,
                _control(
                    name,
                    DRIVER_DEB_VERSION,
                    f"NVIDIA driver metapackage, branch 580 ({flavor} kernel modules)",
                    Conflicts=other,
                    Replaces=other,
                    Provides="nvidia-driver",
                ),
                {
                    "/usr/bin/nvidia-smi": _stub("nvidia-smi", **subst),
                    "/usr/bin/nvidia-persistenced": _stub("nvidia-persistenced", **subst),
                },
                DRIVER_POSTINST.format(version=DRIVER_VERSION, kind=kind),
            )
        subst = {"TOOLKIT_VERSION": TOOLKIT_VERSION}
        _build_deb(
            tmp / "build",
            toolkit_repo,
            _control("nvidia-container-toolkit", TOOLKIT_DEB_VERSION, "NVIDIA Container Toolkit"),
            {
                "/usr/bin/nvidia-ctk": _stub("nvidia-ctk", **subst),
                "/usr/bin/nvidia-container-runtime": _stub("nvidia-container-runtime", **subst),
            },
        )
        gnupghome = tmp / "gnupg"
        gnupghome.mkdir(mode=0o700)
        gpg = ["gpg", "--homedir", str(gnupghome), "--batch", "--yes"]
        sh(
            [
                *gpg,
                "--passphrase",
                "",
                "--quick-gen-key",
                "rigforge testbed <testbed@rigforge.invalid>",
                "rsa3072",
                "sign",
                "never",
            ],
            capture=True,
        )
        armored = sh([*gpg, "--armor", "--export"], capture=True).stdout
        for repo, key in ((driver_repo, DRIVER_KEY), (toolkit_repo, TOOLKIT_KEY)):
            (root / key).write_text(armored)
            _index_and_sign(repo, gnupghome)
        sh(["gpgconf", "--homedir", str(gnupghome), "--kill", "gpg-agent"], check=False)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (root / ".ready").write_text("ok\n")
    log(f"signed apt repos built in {root} in {time.monotonic() - t0:.1f}s")
    return root
