"""Provision every rig of a fleet with the variant named by its host data (`rigforge_variant`).

pyinfra inventories/fleet.py deploy/site.py
"""

from roles.entry import provision

provision()
