"""Provision rigs to serve dual-turbo. Multi-tenant: 4 concurrent agents at full context.

pyinfra inventories/home.py deploy/dual_turbo.py
"""

from roles import rig_lock

rig_lock.ask_first()  # the rig takes its lock and reads its facts while the roles load

from roles import site  # noqa: E402

site.provision_variant("dual-turbo")
