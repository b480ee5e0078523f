"""Test deploy: the host roles alone, in site order (plan, preflight, repair, driver, GPU check, docker, power).

    pyinfra -y <testbed inventory> tests/deploys/host_roles.py [--data gpu_power_limit_w=90]

The plan is roles/site.py's for dual-turbo (host data validated first); the variant's needs are dual-turbo's
shape (2 GPUs, 24 GB cards, no DFlash) but the disk need is small so the testbed's disk passes (host data
`test_variant_gpus` / `test_disk_needed_bytes` change them).
"""

from pyinfra import host

from rigforge.model.hardware import Needs
from roles import docker_engine, gpu_power, nvidia_driver, preflight, site
from roles.operations import recover
from roles.operations.checks import gpus_fit

plan = site.prepare(site.the_fleet("dual-turbo"))
if plan:
    gpus = int(host.data.get("test_variant_gpus", 2))
    disk = int(host.data.get("test_disk_needed_bytes", 1e6))
    needs = Needs("dual-turbo", gpus, 23000, False, plan.layout.models, disk)
    if not preflight.check(needs, plan.knobs, plan.settings):
        plan = None  # refused while preparing: nothing else is queued for this host
if plan:
    recover.packages(name="Repair packages an interrupted run left half-installed (dpkg --configure -a)")
    recover.uploads_cleared(name="Remove uploads an interrupted run left in the upload dir")
    nvidia_driver.install(plan)
    gpus_fit(
        name="Check the GPUs now that the driver answers",
        needs=needs,
        caps=dict(plan.caps),
        power=plan.knobs.gpu_power,
        settings=plan.settings,
    )
    docker_engine.install(plan)
    gpu_power.apply(plan)
