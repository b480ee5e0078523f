"""One rig at home. Replace the address and user with yours, then:

    pyinfra inventories/home.py deploy/dual_turbo.py

The SSH user needs passwordless sudo (group_data/all.py sets _sudo). Per-rig knobs go in the dict, e.g.
{"gpu_power_limit_w": 250} or {"serving_port": 8111}; see README "Knobs".
"""

rigs = [
    ("rig.example.lan", {"ssh_user": "rigforge"}),
]
