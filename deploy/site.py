"""Provision every rig of a fleet with the variant named by its host data (`rigforge_variant`).

pyinfra inventories/fleet.py deploy/site.py
"""

from roles import rig_lock

rig_lock.ask_first()  # the rig takes its lock and reads its facts while the roles load

from roles import site  # noqa: E402

site.provision_variant()
