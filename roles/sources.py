"""Sources: git checkouts at the lock's pinned commits under <rigforge_root>/src/<name> (roles/operations/gitpin.py)."""

from pyinfra.api import deploy
from pyinfra.operations import apt, files

from rigforge.model.fleet import Plan
from roles.operations import gitpin


@deploy("Pinned git sources")
def apply(plan: Plan) -> None:
    """git, and each of the plan's pinned sources checked out at its commit under the sources directory."""
    layout = plan.layout
    apt.packages(name="Install git", packages=["git", "ca-certificates"], no_recommends=True)
    files.directory(name=f"Sources directory {layout.src_root}", path=layout.src_root, mode="755")
    for pin in plan.sources:
        gitpin.checkout(
            name=f"Check out {pin.name} at {pin.commit[:12]}" + (" (sparse)" if pin.sparse else ""),
            pin=pin,
            dest=layout.src(pin.name),
        )
