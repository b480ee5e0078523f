"""Repairs, run early by roles/site.py, of dpkg killed mid-install and of uploads left in the SSH user's private dir by
an interrupted run; other half-done states are repaired where they arise (`staged_files`, `hfweights.fetched`).
"""

import shlex

from pyinfra import host
from pyinfra.api import StringCommand, operation

from rigforge.observe.facts.apt import DpkgInterrupted
from rigforge.observe.facts.system import LeftoverUploads
from roles.operations.shown import Commands, repairing, unchanged
from roles.operations.staged import private_upload_dir

APT_ENV = "DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a"
DPKG_OPTIONS = "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold"  # keep edited conffiles


@operation()
def packages() -> Commands:
    """``dpkg --configure -a``, ``apt-get -f install`` when an interrupted run left dpkg needing them (no arguments).

    **Example:**

    .. code:: python

        from roles.operations import recover
        recover.packages(name="Repair packages an interrupted run left half-installed (dpkg --configure -a)")
    """
    reason = host.get_fact(DpkgInterrupted)
    if unchanged(not reason, "dpkg state is clean"):
        return
    repairing(
        f"an earlier run was interrupted ({reason}); repairing with `dpkg --configure -a` and `apt-get -f install`"
    )
    yield StringCommand(f"{APT_ENV} dpkg --configure -a --force-confdef --force-confold")
    yield StringCommand(f"{APT_ENV} apt-get -y -f install {DPKG_OPTIONS}")


@operation()
def uploads_cleared() -> Commands:
    """Remove what an interrupted upload left in the SSH user's private upload dir, secrets included (no arguments).

    **Example:**

    .. code:: python

        from roles.operations import recover
        recover.uploads_cleared(name="Remove uploads an interrupted run left in the upload dir")
    """
    path = private_upload_dir()
    left = host.get_fact(LeftoverUploads, path=path)
    if unchanged(not left, "no leftover uploads"):
        return
    repairing(f"removing {len(left)} file(s) an interrupted upload left in {path}")
    yield StringCommand("rm", "-rf", *[shlex.quote(p) for p in left])
