"""Provision rigs to serve dual-dflash. Peak code TPS with vision.

TP=2, DFlash N=5 draft, FP16 (default) KV, bf16 dtype, 1 stream, 185K, vision on, no Genesis

    pyinfra inventories/home.py deploy/dual_dflash.py
"""

from roles import rig_lock

rig_lock.provision("dual-dflash")  # the rig takes its lock and reads its facts while the roles load
