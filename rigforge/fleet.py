"""The fleet: one model of every host of a run, built once on the controller; each host's plan is a view of it.

`build` reads the inventory once: each host's roles (a rig, the gateway, the fleet registry), every rig's plan
exactly as that rig deploys it, and the fleet registry's plan. What other hosts read from a rig's plan (its model,
port, image, address, API key) never depends on the rig's probe, so the gateway hosts take their backends
(`rigs`) and the registry host its fill list (`images`) from here and rebuild nothing. Only the rig itself
completes its plan with what its probe shows (`completed`: the GPU count, the other cap writers).

A problem belongs to the host whose data is wrong: a rig refused is left out of the gateway with its reason
(`left_out`); a bad registry setting refuses the registry host only, and the rigs go on without it.

Host data is read here only (`host_data`: every role's knobs with its defaults, rigforge/knobs/; `plan_for`: their
checks, then rigforge/plan.py), for the deploy (roles/site.py `the_fleet`) and every command alike; no role is
imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from rigforge import obtain, schema
from rigforge import plan as planner
from rigforge.catalog import CatalogError
from rigforge.knobs import docker_engine, gpu_power, images, nvidia_driver, serving, site, sources, weights
from rigforge.knobs import gateway as gateway_knobs
from rigforge.knobs import monitor as monitor_knobs
from rigforge.knobs import registry as registry_knobs
from rigforge.pins import LockError
from rigforge.plan import Plan
from rigforge.recipes import RecipeError
from rigforge.registry import REGISTRY, RegistryPlan, registry_host
from rigforge.registry import build as registry_build

RIG = "rig"  # with GATEWAY and REGISTRY: the roles a host can have in the fleet

# every role's knobs host data may set (checked by every plan), and those only deploy/images_load.py reads
KNOBS = (
    nvidia_driver,
    docker_engine,
    gpu_power,
    sources,
    weights,
    serving,
    gateway_knobs,
    registry_knobs,
    monitor_knobs,
)
LOADS = (images,)
GATEWAY = "gateway"  # the inventory group of the fleet's gateway hosts
MONITOR = "monitor"  # the inventory group of the host that runs Prometheus (docs/monitoring.md)


@dataclass(frozen=True)
class Fleet:
    roles: Mapping[str, frozenset[str]]  # every host's roles, in inventory order
    plans: Mapping[str, Plan | None]  # every rig's plan (None: refused, see problems)
    problems: Mapping[str, tuple[str, ...]]  # every rig's problems with its plan
    registry_host: str | None = None
    registry: RegistryPlan | None = None
    registry_problems: tuple[str, ...] = ()
    # the monitor's scrape targets: {job: ((host, "address:port"), ...)}: every rig's node exporter and vLLM, every
    # gateway's HAProxy exporter
    targets: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def has(self, name: str, role: str) -> bool:
        """Whether host `name` has `role` in the fleet (RIG, GATEWAY, REGISTRY, MONITOR)."""
        return role in self.roles.get(name, ())

    def is_rig(self, name: str) -> bool:
        return self.has(name, RIG)

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
    def monitors(self) -> tuple[str, ...]:
        """The hosts of the inventory group `monitor`: where the fleet's Prometheus runs."""
        return tuple(name for name, roles in self.roles.items() if MONITOR in roles)

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


def build(hosts, variant=None, *, gpus: int | None = None, deployable: bool = True, opt_in: bool = False) -> Fleet:
    """The fleet of `hosts` (a pyinfra inventory, or any hosts with .name, .groups and .data) for `variant`
    (deploy/<variant>.py's name; None: each host's rigforge_variant; or a variant object): every rig's plan before
    its probe, the registry's plan, each built once, for the deploy and every command. `gpus`: every rig's (render's
    --gpus); `deployable`: as plan_for's; `opt_in`: every recipe taken as opted in (status, verify)."""
    roles, plans, problems, datas = {}, {}, {}, {}
    for h in hosts:
        mine = {g for g in (GATEWAY, REGISTRY, MONITOR) if g in h.groups} | ({RIG} if is_rig(h) else set())
        datas[h.name] = {**host_data(h.data), "rigforge_recipe_opt_in": True} if opt_in else h.data
        if RIG in mine:
            plans[h.name], found = plan_for(h.name, datas[h.name], variant, gpus, deployable)
            problems[h.name] = tuple(found)
        roles[h.name] = frozenset(mine)
    reg_name = registry_host({REGISTRY: [name for name, mine in roles.items() if REGISTRY in mine]})
    reg_data = host_data(datas[reg_name]) if reg_name else {}
    reg_problems = registry_knobs.validate(reg_data) if reg_name else []
    return Fleet(
        roles=MappingProxyType(roles),
        plans=MappingProxyType(plans),
        problems=MappingProxyType(problems),
        registry_host=reg_name,
        registry=registry_build(reg_name, reg_data) if reg_name and not reg_problems else None,
        registry_problems=tuple(reg_problems),
        targets=MappingProxyType(
            targets(
                plans.values(),
                {n: host_data(datas[n]) for n, r in roles.items() if GATEWAY in r},
                {n for n, r in roles.items() if MONITOR in r},
            )
        ),
    )


def targets(
    plans: Iterable[Plan | None], gateways: Mapping[str, Mapping], monitors: Iterable[str] = ()
) -> dict[str, tuple[tuple[str, str], ...]]:
    """The monitor's scrape targets, by job: each rig at the address the gateway reaches it on (its
    `gateway_address`, else its inventory name), each gateway host at its bind address, else its name, or
    127.0.0.1 when it is the monitor host itself (listening on every address)."""
    rigs = [(p.host, p.data.get("gateway_address") or p.host, p) for p in plans if p is not None]
    local = set(monitors)
    return {
        "node": tuple((name, f"{addr}:{p.data['monitor_node_exporter_port']}") for name, addr, p in rigs),
        "vllm": tuple((name, f"{addr}:{p.port}") for name, addr, p in rigs),
        "haproxy": tuple(
            (
                name,
                f"{data.get('gateway_bind_address') or ('127.0.0.1' if name in local else name)}:"
                f"{data['gateway_metrics_port']}",
            )
            for name, data in gateways.items()
        ),
    }


def host_data(data) -> dict:
    """A host's data (pyinfra's host.data, or any mapping) for every role's knob and the settings' keys, role
    defaults applied: the only read of host data."""
    defaults = {key: value for module in (*KNOBS, *LOADS) for key, value in module.DEFAULTS.items()} | site.DEFAULTS
    keys = {*defaults, *schema.HOST_KEYS.values(), *site.RETIRED, "ssh_port"}
    return {key: data.get(key, defaults.get(key)) for key in sorted(keys)}


def plan_for(name: str, data, entry=None, gpus: int | None = None, deployable: bool = True, cap_units=()):
    """(the plan of host `name` from its host data (`data`: host.data or a mapping), or None; every problem): the
    roles' knob checks and the plan's (rigforge/plan.py). What the deploy, status, verify and render all use;
    `deployable` False (status, verify, render) accepts lock entries not yet resolved; `cap_units`: the rig's
    other units that set power caps at boot (the power unit is ordered after them)."""
    data = host_data(data)
    problems = site.validate(data)
    for module in KNOBS:
        check = getattr(module, "validate", None)  # a role without knobs to check has none
        if check:
            problems += check(data)
    try:
        return planner.build(
            name, data, entry, gpus=gpus, cap_units=cap_units, problems=problems, deployable=deployable
        )
    except (CatalogError, LockError, RecipeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, [*problems, f"cannot prepare this host: {type(exc).__name__}: {exc}"]


def is_rig(h) -> bool:
    """Every host is a rig but those only in the groups `gateway`, `registry` or `monitor` (such a host that is
    also a rig is in `rigs`)."""
    return not {GATEWAY, REGISTRY, MONITOR} & set(h.groups) or "rigs" in h.groups
