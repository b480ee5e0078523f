"""`rigforge testbed up` on a fresh machine: as root on Debian/Ubuntu it installs the missing host packages and
says so; otherwise one line says what to install. The "fresh machine" is a testbed rig's Debian 13 root file
system (no debootstrap, sshd or apt-utils in it), entered with chroot; the packages come from Debian's mirror."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rigforge.testbed import rootfs

pytestmark = pytest.mark.testbed
TESTBED_PKG = Path(__file__).resolve().parents[2] / "rigforge" / "testbed"
ENSURE = "import sys; sys.path.insert(0, '/opt'); from tb import hostpkgs; hostpkgs.ensure(); print('ready')"


def _chroot(root: Path, *argv: str, user: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["chroot", *([f"--userspec={user}"] if user else []), str(root), *argv]
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_up_installs_missing_host_packages_as_root_on_debian(testbed_factory):
    tb = testbed_factory(name="hostpkgs")
    root = tb.rig("rig1").rootfs
    pkg = root / "opt/tb"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("_util.py", "hostpkgs.py"):  # the code `testbed up` runs first, with no dependencies
        shutil.copy(TESTBED_PKG / name, pkg / name)
    rootfs.copy_host_network_config(root)  # reach Debian's mirror from the chroot
    assert not (root / "usr/sbin/debootstrap").exists() and not (root / "usr/sbin/sshd").exists()

    as_user = _chroot(root, "python3", "-c", ENSURE, user="rigadmin")  # not root: one line, what to install
    lines = as_user.stderr.strip().splitlines()
    assert as_user.returncode != 0 and "ready" not in as_user.stdout
    assert lines[-1].endswith(
        "TestbedError: the testbed needs root (chroot, sshd per rig, useradd): as root, "
        "apt-get install debootstrap openssh-server openssh-client apt-utils, then run it again"
    ), as_user.stderr

    os_release = (root / "usr/lib/os-release").read_text()
    (root / "etc/os-release").unlink(missing_ok=True)
    (root / "etc/os-release").write_text('ID=fedora\nPRETTY_NAME="Fedora Linux 42"\n')
    other = _chroot(root, "python3", "-c", ENSURE)
    assert other.returncode != 0
    assert (
        other.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "Fedora Linux 42 is not Debian/Ubuntu: install these with its package manager, then run again as root: "
            "debootstrap (debootstrap), sshd (openssh-server), ssh-keygen (openssh-client), apt-ftparchive (apt-utils)"
        )
    ), other.stderr
    (root / "etc/os-release").write_text(os_release)

    res = _chroot(root, "python3", "-c", ENSURE)  # root on Debian: installs them and says so
    assert res.returncode == 0 and res.stdout.strip() == "ready", res.stderr
    assert (
        "installing the testbed's host packages: apt-get install debootstrap openssh-server openssh-client apt-utils"
        in res.stderr
    )
    for tool in ("usr/sbin/debootstrap", "usr/sbin/sshd", "usr/bin/apt-ftparchive"):
        assert (root / tool).exists(), tool
    again = _chroot(root, "python3", "-c", ENSURE)  # nothing missing: nothing installed, nothing said
    assert again.returncode == 0 and "installing" not in again.stderr
