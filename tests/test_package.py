"""`pip install .` (not editable) into a fresh venv, from a directory other than the checkout: the installed
`rigforge render` and `rigforge testbed up` work on their own (templates, the default lock, the weights script
and the testbed stubs are package data; templates/ and rigforge.lock.yaml stay the source of truth).

Slow (a venv and a real pip install from the package index) and `testbed up` needs root: marked testbed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.testbed


def sh(*cmd, cwd, timeout=900, env=None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**clean, **(env or {})}
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("pkg")
    venv = work / "venv"
    assert sh(sys.executable, "-m", "venv", venv, cwd=work).returncode == 0
    pip = sh(venv / "bin/pip", "install", "-q", str(REPO), cwd=work)
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv


def test_installed_package_is_not_the_checkout(installed):
    where = sh(
        installed / "bin/python", "-c", "import rigforge.model.render as r; print(r.__file__, r.TEMPLATES)", cwd="/"
    )
    module, templates = where.stdout.split()
    assert str(REPO) not in module and str(REPO) not in templates, where.stdout
    assert Path(templates, "docker-compose.yml.j2").is_file()


def test_installed_render_matches_the_checkout(installed, tmp_path):
    out, ref = tmp_path / "installed", tmp_path / "checkout"
    r = sh(installed / "bin/rigforge", "render", "dual-turbo", "--out", out, "--set", "port=8111", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = sh(sys.executable, "-m", "rigforge.cli", "render", "dual-turbo", "--out", ref, "--set", "port=8111", cwd=REPO)
    assert r.returncode == 0, r.stderr
    for name in ("docker-compose.yml", ".env", "rigforge-vllm@.service", "rigforge-gpu-power.service"):
        assert (out / name).read_text() == (ref / name).read_text(), name
    bad = sh(installed / "bin/rigforge", "render", "dual", "--out", out, "--set", "power_limit_w=5000", cwd=tmp_path)
    assert bad.returncode == 2 and "gpu_power_limit_w must be whole watts in 100..600" in bad.stderr
    lock = sh(installed / "bin/rigforge", "lock", "--check", cwd=tmp_path)  # the default lock is package data
    assert "rigforge.lock.yaml" in lock.stdout + lock.stderr and "No such file" not in lock.stderr


def test_installed_testbed_up_gives_rigs_reachable_over_ssh(installed, testbed_dir, tmp_path):
    tb_dir = testbed_dir / "fleets" / f"pkg-{os.getpid()}"
    (tb_dir / "cache").mkdir(parents=True, exist_ok=True)
    for tarball in (testbed_dir / "cache").glob("rootfs-*.tar*"):  # reuse the built rootfs (saves a debootstrap)
        shutil.copy2(tarball, tb_dir / "cache" / tarball.name)
    try:
        up = sh(installed / "bin/rigforge", "testbed", "up", "--dir", tb_dir, "--gpus", "1", cwd=tmp_path)
        assert up.returncode == 0, up.stderr[-3000:]
        inventory = Path(up.stdout.strip().splitlines()[-1])
        assert inventory.is_file()
        r = sh(installed / "bin/pyinfra", "-y", inventory, "exec", "--", "ls /sys/bus/pci/devices", cwd=tmp_path)
        assert r.returncode == 0 and "0000:01:00.0" in r.stdout + r.stderr, r.stderr[-3000:]
    finally:
        sh(installed / "bin/rigforge", "testbed", "down", "--dir", tb_dir, "--purge", cwd=tmp_path)
        shutil.rmtree(tb_dir, ignore_errors=True)
