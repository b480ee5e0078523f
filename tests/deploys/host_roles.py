"""Test deploy: the host roles alone, in site order (preflight, driver, docker + toolkit, GPU power).

    pyinfra -y <testbed inventory> tests/deploys/host_roles.py [--data gpu_power_limit_w=90]

The variant's needs are fixed to dual-turbo's shape (2 GPUs, 24 GB cards, no DFlash); the disk need is small
so the testbed's disk passes (host data `test_variant_gpus` / `test_disk_needed_bytes` change them).
The power unit is rendered by rigforge.render from the caps in host data.
"""

from pyinfra import host

from rigforge.render import render_power_unit
from roles import docker_engine, gpu_power, nvidia_driver, preflight
from roles.operations.checks import Needs

gpus = int(host.data.get("test_variant_gpus", 2))
default_w = host.data.get("gpu_power_limit_w", gpu_power.DEFAULTS["gpu_power_limit_w"])
overrides = host.data.get("gpu_power_limits") or {}
try:
    caps = {i: int(overrides.get(i, default_w)) for i in range(gpus)}
except (TypeError, ValueError):
    caps = {i: 0 for i in range(gpus)}  # preflight refuses the value with a message

preflight.check(
    Needs("dual-turbo", gpus, 23000, False, "/opt/rigforge/models", int(host.data.get("test_disk_needed_bytes", 1e6)))
)
nvidia_driver.install()
docker_engine.install()
gpu_power.apply(render_power_unit(caps))
