"""Provision rigs to serve carnice-bf16mtp. Hermes agentic fine-tune (Carnice tool specialization).

pyinfra inventories/home.py deploy/carnice_bf16mtp.py
"""

from roles import rig_lock

rig_lock.ask_first()  # the rig takes its lock and reads its facts while the roles load

from roles import site  # noqa: E402

site.provision_variant("carnice-bf16mtp")
