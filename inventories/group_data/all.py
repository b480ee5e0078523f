"""Defaults for every rig in inventories/ (role defaults < this < per-group files < host data)."""

_sudo = True  # rigs are reached as a normal user with passwordless sudo
gpu_power_limit_w = 230  # the recipes' cap per card; 330 W buys ~+10% TPS at ~660 W per rig
docker_source = "docker"  # Docker's own repository (engine + compose v2 plugin)
nvidia_driver_branch = "580"  # CUDA 13 runtime in the pinned vLLM image needs 580+
nvidia_allow_reboot = False  # stop with "reboot needed" instead of rebooting a rig by itself
