"""Sources: git checkouts at the lock's pinned commits under <rigforge_root>/src/<name>.

Each source is fetched shallow and blobless at exactly its pinned SHA, sparse when the lock lists paths,
checked out detached, and its locked files verified with sha256sum on the rig. A dirty tree is repaired
(reset + clean, reported in the output). An unresolved lock entry stops the host before anything changes:
run `rigforge lock` on a networked controller (docs/pins.md).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files

from rigforge.pins import Lock, LockError
from roles.operations import gitpin
from roles.operations.checks import refuse

DEFAULTS = {
    "rigforge_root": "/opt/rigforge",  # root of the host layout; checkouts go to <root>/src/<name>
}


@deploy("Pinned git sources", data_defaults=DEFAULTS)
def apply(lock: Lock, names: list[str]):
    try:
        lock.require(git=names)
    except LockError as exc:
        refuse(name=f"Refuse {host.name}: unresolved sources", message=f"{host.name}: {exc}")
        return
    src = f"{host.data.get('rigforge_root')}/src"
    apt.packages(name="Install git", packages=["git", "ca-certificates"], no_recommends=True)
    files.directory(name=f"Sources directory {src}", path=src, mode="755")
    for name in names:
        pin = lock.git[name]
        gitpin.checkout(
            name=f"Check out {name} at {pin.commit[:12]}" + (" (sparse)" if pin.sparse else ""),
            source=name,
            url=pin.url,
            commit=pin.commit,
            dest=f"{src}/{name}",
            sparse=list(pin.sparse),
            files=dict(pin.files),
        )
