"""The deploy files' entry (deploy/<variant>.py, deploy/site.py): the rig's lock is asked for before the roles
load. Its request carries the batched probe (roles/rig_lock.py `ask`), so the rig takes the lock and reads its
facts while the controller imports the roles and builds the fleet; roles/site.py `provision` then reads the
answer. Only light modules are imported here."""

from __future__ import annotations

from pyinfra.context import ctx_host

from rigforge.facts import probe
from roles import rig_lock


def provision(variant_name: str | None = None) -> None:
    """roles/site.py `provision(variant_name)`, with this host's lock asked for first."""
    probe.install_all()  # the probe's request is built from the facts recorded for this host
    rig_lock.ask(ctx_host.get())
    from roles import site  # the roles load while the rig answers

    site.provision(variant_name)
