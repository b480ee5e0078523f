"""Every role's knobs of one host in one typed bundle (`RoleKnobs`): what a rig's plan carries. Its own module, not
rigforge/model/knobs/__init__.py, which each role's module imports (for `Knobs`)."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from rigforge.model.knobs.docker_engine import DockerEngine
from rigforge.model.knobs.gateway import Gateway
from rigforge.model.knobs.gpu_power import GpuPower
from rigforge.model.knobs.monitor import Monitor
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.registry import Registry
from rigforge.model.knobs.serving import Serving
from rigforge.model.knobs.site import Site
from rigforge.model.knobs.weights import Weights


@dataclasses.dataclass(frozen=True)
class RoleKnobs:
    """Every role's knobs of one host, typed, each at its default unless host data sets it: what a rig's plan carries
    (`Plan.knobs`), built once from the host data the plan was checked against (rigforge/model/fleet.py build_plan). A
    role reads `plan.knobs.serving.rigforge_manage_services`, never a host-data key."""

    site: Site  # the deploy's own (roles/site.py): which variant, which lock
    driver: NvidiaDriver  # the NVIDIA driver and the apt state around it (roles/nvidia_driver.py)
    docker: DockerEngine  # Docker and the NVIDIA Container Toolkit (roles/docker_engine.py)
    gpu_power: GpuPower  # the GPUs' power caps (roles/gpu_power.py)
    weights: Weights  # the weights download (roles/weights.py)
    serving: Serving  # how the vLLM unit is run and gated (roles/serving.py)
    gateway: Gateway  # the fleet's gateway: on a rig, the address it is reached on and its drain timeout
    registry: Registry  # the fleet registry (roles/registry.py)
    monitor: Monitor  # the monitor host's Prometheus; on a rig, its node exporter's port

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Self:
        """Every role's knobs host `data` sets, each other one at its default (`Knobs.of`)."""
        return cls(
            site=Site.of(data),
            driver=NvidiaDriver.of(data),
            docker=DockerEngine.of(data),
            gpu_power=GpuPower.of(data),
            weights=Weights.of(data),
            serving=Serving.of(data),
            gateway=Gateway.of(data),
            registry=Registry.of(data),
            monitor=Monitor.of(data),
        )
