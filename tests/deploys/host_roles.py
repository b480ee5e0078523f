"""Test deploy: the host roles alone, in site order (plan, preflight, driver, GPU check, docker + toolkit, power).

    pyinfra -y <testbed inventory> tests/deploys/host_roles.py [--data gpu_power_limit_w=90]

The plan is roles/site.py's for dual-turbo (host data validated first); the variant's needs are dual-turbo's
shape (2 GPUs, 24 GB cards, no DFlash) but the disk need is small so the testbed's disk passes (host data
`test_variant_gpus` / `test_disk_needed_bytes` change them).
"""

from pyinfra import host

from roles import docker_engine, gpu_power, nvidia_driver, preflight, site
from roles.operations.checks import Needs

plan = site.prepare("dual-turbo")
if plan:
    gpus = int(host.data.get("test_variant_gpus", 2))
    disk = int(host.data.get("test_disk_needed_bytes", 1e6))
    needs = Needs("dual-turbo", gpus, 23000, False, plan.layout.models, disk)
    preflight.check(needs)
    nvidia_driver.install()
    docker_engine.install()
    gpu_power.apply(plan)
