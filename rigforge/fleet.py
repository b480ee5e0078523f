"""The fleet: one model of every host of a run, built once on the controller; each host's plan is a view of it.

`build` reads the inventory once: each host's roles (a rig, the gateway, the fleet registry), every rig's plan
exactly as that rig deploys it, and the fleet registry's plan. What other hosts read from a rig's plan (its model,
port, image, address, API key) never depends on the rig's probe, so the gateway hosts take their backends
(`rigs`) and the registry host its fill list (`images`) from here and rebuild nothing. Only the rig itself
completes its plan with what its probe shows (`completed`: the GPU count, the other cap writers).

A problem belongs to the host whose data is wrong: a rig refused is left out of the gateway with its reason
(`left_out`); a bad registry setting refuses the registry host only, and the rigs go on without it.

The plan builder is the caller's (roles/site.py `plan_for`: the roles' knob checks, then rigforge/plan.py), so
this module knows no role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from rigforge import obtain
from rigforge.plan import Plan
from rigforge.registry import REGISTRY, RegistryPlan, registry_host

RIG, GATEWAY = "rig", "gateway"  # with REGISTRY: the roles a host can have in the fleet


@dataclass(frozen=True)
class Fleet:
    roles: Mapping[str, frozenset[str]]  # every host's roles, in inventory order
    plans: Mapping[str, Plan | None]  # every rig's plan (None: refused, see problems)
    problems: Mapping[str, tuple[str, ...]]  # every rig's problems with its plan
    registry_host: str | None = None
    registry: RegistryPlan | None = None
    registry_problems: tuple[str, ...] = ()

    def is_rig(self, name: str) -> bool:
        return RIG in self.roles.get(name, ())

    def rigs(self) -> list[Plan]:
        """The plans of the rigs this run deploys (refused ones left out), in inventory order."""
        return [p for p in self.plans.values() if p is not None]

    def left_out(self) -> dict[str, str]:
        """{rig: the first problem that refused its plan}: what the gateway and registry hosts warn about."""
        return {name: problems[0] for name, problems in self.problems.items() if self.plans.get(name) is None}

    @property
    def gateways(self) -> tuple[str, ...]:
        return tuple(name for name, roles in self.roles.items() if GATEWAY in roles)

    @property
    def images(self) -> tuple[str, ...]:
        """The locked Docker Hub images (ref@sha256:...) the rigs run: what the fleet registry holds."""
        refs = {p.image for p in self.rigs() if (ref := obtain.parse(p.image)).digest and ref.on_docker_hub}
        return tuple(sorted(refs))

    def completed(self, name: str, gpus: int | None, cap_units: Iterable[str], rebuild: Callable) -> tuple:
        """(rig `name`'s plan with what its probe shows, or None; its problems): `gpus` (None: not known yet) and
        `cap_units`. A GPU count other than the plan's rebuilds it (`rebuild(gpus)` -> (plan, problems));
        otherwise nothing is built or rendered again."""
        plan = self.plans.get(name)
        if plan is None:
            return None, list(self.problems.get(name, ()))
        if gpus is None or gpus == len(plan.caps):
            return replace(plan, cap_units=tuple(cap_units)), []
        return rebuild(gpus)


def build(
    inventory,
    plan_of: Callable[[object], tuple[Plan | None, list[str]]],
    registry_of: Callable[[object], tuple[RegistryPlan | None, list[str]]],
) -> Fleet:
    """The fleet of a pyinfra inventory: `plan_of(host)` builds a rig's plan before its probe, `registry_of(host)`
    the registry host's plan, each called once."""
    hosts = list(inventory)
    in_group = {g: [h.name for h in inventory.get_group(g, default=[])] for g in (GATEWAY, REGISTRY)}
    reg_name = registry_host(in_group)
    roles, plans, problems = {}, {}, {}
    for h in hosts:
        mine = {g for g in (GATEWAY, REGISTRY) if h.name in in_group[g]}
        if not mine or "rigs" in h.groups:  # a gateway or registry host is a rig only when in `rigs` too
            mine.add(RIG)
            plans[h.name], found = plan_of(h)
            problems[h.name] = tuple(found)
        roles[h.name] = frozenset(mine)
    reg, reg_problems = (None, [])
    if reg_name is not None:
        reg, reg_problems = registry_of(next(h for h in hosts if h.name == reg_name))
    return Fleet(
        roles=MappingProxyType(roles),
        plans=MappingProxyType(plans),
        problems=MappingProxyType(problems),
        registry_host=reg_name,
        registry=None if reg_problems else reg,
        registry_problems=tuple(reg_problems),
    )
