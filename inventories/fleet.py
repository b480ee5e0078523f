"""A fleet: each rig names its variant; 20 GB-card rigs get the documented override from their group.

    pyinfra inventories/fleet.py deploy/site.py --limit rig-a.example.lan   # canary first
    pyinfra inventories/fleet.py deploy/site.py --serial --fail-percent 0   # then the rest, one at a time

Group data: group_data/all.py (every rig), group_data/small_cards.py (2x 20 GB cards).
"""

rigs = [
    ("rig-a.example.lan", {"ssh_user": "rigforge", "rigforge_variant": "dual"}),
    ("rig-b.example.lan", {"ssh_user": "rigforge", "rigforge_variant": "dual-turbo"}),
    ("rig-c.example.lan", {"ssh_user": "rigforge", "rigforge_variant": "dual-dflash"}),
]

small_cards = [
    ("rig-d.example.lan", {"ssh_user": "rigforge", "rigforge_variant": "dual-turbo"}),
]
