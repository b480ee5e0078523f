"""Repairs of what an interrupted run leaves behind (a killed controller, a dropped link), run early by roles/site.py.

- Packages: a dpkg killed mid-install leaves packages unpacked or half-configured and apt refusing everything
  ("E: dpkg was interrupted, you must manually run 'dpkg --configure -a'"). Only when dpkg's own audit or its
  journal (/var/lib/dpkg/updates) shows that, `dpkg --configure -a` then `apt-get -f install` repair it, and the
  run says so. A clean rig gets a no-op.
- Uploads: a file pyinfra was copying through the SSH user's private upload dir (`.env`, token) is removed.

Other half-done states are repaired where they arise: staged files (`staged_files`: leftover staging dir, a
half-moved compose), weights (`hfweights.fetched`: `*.part` resume, leftover staging and token files).
"""

from __future__ import annotations

import shlex

from pyinfra import host, logger, state
from pyinfra.api import FactBase, StringCommand, operation

from roles.operations.staged import private_upload_dir

APT_ENV = "DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a"
DPKG_OPTIONS = "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"  # keep edited conffiles


class DpkgInterrupted(FactBase):
    """Why dpkg needs `--configure -a` (a short reason), or None when its state is clean.

    Reads dpkg's journal dir (non-empty: a dpkg run was interrupted) and `dpkg --audit` (packages unpacked,
    half-configured or half-installed); both work while dpkg is in that state."""

    def command(self) -> str:
        return (
            "if [ -n \"$(ls -A /var/lib/dpkg/updates 2>/dev/null)\" ]; then echo 'journal: dpkg was interrupted'; fi; "
            "dpkg --audit 2>&1 | grep -E '^ [a-z0-9][a-z0-9+.-]+ ' | head -n 20 | sed 's/^ /audit: /'; true"
        )

    def process(self, output: list[str]) -> str | None:
        lines = [line.strip() for line in output if line.strip()]
        if not lines:
            return None
        packages = [line.split()[1] for line in lines if line.startswith("audit:") and len(line.split()) > 1]
        reason = "dpkg was interrupted" if any(line.startswith("journal:") for line in lines) else ""
        if packages:
            reason += ("; " if reason else "") + f"not fully installed: {', '.join(sorted(set(packages)))}"
        return reason or None


class LeftoverUploads(FactBase):
    """Files left in the SSH user's private upload dir by an interrupted upload (a list of paths)."""

    def command(self, path: str) -> str:
        return f"find {shlex.quote(path)} -mindepth 1 -maxdepth 1 2>/dev/null || true"

    @staticmethod
    def default() -> list:
        return []

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


@operation()
def packages():
    """`dpkg --configure -a` and `apt-get -f install`, only when an interrupted run left dpkg needing them."""
    reason = host.get_fact(DpkgInterrupted)
    if not reason:
        host.noop("dpkg state is clean")
        return
    if state.is_executing:
        host.log_styled(
            f"{host.name}: an earlier run was interrupted ({reason}); repairing with "
            "`dpkg --configure -a` and `apt-get -f install`",
            fg="yellow",
            log_func=logger.warning,
        )
    yield StringCommand(f"{APT_ENV} dpkg --configure -a --force-confdef --force-confold")
    yield StringCommand(f"{APT_ENV} apt-get -y -f install {DPKG_OPTIONS}")


@operation()
def uploads_cleared():
    """Remove what an interrupted upload left in the SSH user's private upload dir (secrets included)."""
    path = private_upload_dir()
    left = host.get_fact(LeftoverUploads, path=path)
    if not left:
        host.noop("no leftover uploads")
        return
    if state.is_executing:
        host.log_styled(
            f"{host.name}: removing {len(left)} file(s) an interrupted upload left in {path}",
            fg="yellow",
            log_func=logger.warning,
        )
    yield StringCommand("rm", "-rf", *[shlex.quote(p) for p in left])
