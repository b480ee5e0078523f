"""The roles of one host in order (`provision`): the fleet's own hosts' roles, then a rig's plan (rigforge/fleet.py) and
its roles, which read only the plan. Any problem refuses a host in one message, its first operation, so nothing changes.
"""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FileContents

import rigforge.knobs.gateway
import rigforge.knobs.images
import rigforge.knobs.monitor
from rigforge import fleet, gateway, images, obtain, power, registry, schema, verdict
from rigforge.facts import probe
from rigforge.facts.docker import DockerImagePresent
from rigforge.facts.files import JsonFile, TreeSize
from rigforge.facts.hfweights import WeightsState
from rigforge.facts.nvidia import NvidiaGpus, NvidiaPciGpus, PowerCapUnits
from rigforge.fleet import GATEWAY, MONITOR, REGISTRY, Plan, host_data, is_rig, plan_for
from rigforge.hardware import Needs, changed_roots, data_root_of, format_problems, gpu_count, roots_inside
from rigforge.inventory import sudo_problem
from rigforge.knobs.site import DEFAULTS
from rigforge.layout import DAEMON_JSON, HostLayout
from rigforge.lock import token_refused
from roles import docker_engine, gpu_power, interrupt, nvidia_driver, preflight, rig_lock, serving, sources, weights
from roles import gateway as gateway_role
from roles import images as images_role
from roles import monitor as monitor_role
from roles import registry as registry_role
from roles.operations import aptlock, recover
from roles.operations.checks import gpus_fit, refuse_now
from roles.operations.shown import warn

IMAGE_GB = 9  # the vLLM nightly image on disk (HARDWARE.md)


def the_fleet(variant=None) -> fleet.Fleet:
    """This run's fleet (rigforge/fleet.py), built once on the controller at the first host's turn."""
    memo = ctx_state.get().__dict__.setdefault("_rigforge_fleets", {})
    key = variant if variant is None or isinstance(variant, str) else id(variant)
    if key not in memo:
        memo[key] = fleet.build(host.inventory, variant)
    return memo[key]


def refused(problems: list[str], role: str) -> bool:
    """Refuse this host, naming every problem with `role` (one of the fleet's own hosts); True when refused."""
    if problems:
        message = format_problems(host.name, problems, what=f"rigforge refused {role}")
        refuse_now(f"Refuse {host.name}: {len(problems)} problem(s) with {role}", message)
    return bool(problems)


def serve_the_registry(variant=None) -> bool:
    """On the fleet registry's host, the registry (roles/registry.py); False when it was refused (that host only)."""
    fl = the_fleet(variant)
    if host.name != fl.registry_host:
        return True
    reg, problems = fl.registry, list(fl.registry_problems)
    try:
        tls = None if problems or reg.insecure else registry.server_certificate(reg.ca_dir, reg.address)
        ca = None if problems or reg.insecure else registry.ca_certificate(reg.ca_dir)
    except registry.RegistryError as error:
        problems = [str(error)]
    if not refused(problems, "the fleet registry"):
        registry_role.serve(reg, tls, host_data(host.data)["rigforge_manage_services"], ca, fl.images)
    return not problems


def trust_the_registry(plan: Plan, fl: fleet.Fleet) -> None:
    """On a rig, trust the fleet registry; one refused on its own host is only a warning here."""
    reg, problems = fl.registry, list(fl.registry_problems)
    try:
        ca = None if reg is None or reg.insecure else registry.ca_certificate(reg.ca_dir)
    except registry.RegistryError as error:
        reg, problems = None, [str(error)]
    if problems:
        warn(f"the fleet registry on {fl.registry_host} is left out (that host is refused): {problems[0]}")
    if reg is not None:
        registry_role.trust(reg, ca, plan.layout.daemon_json, plan.data["rigforge_manage_services"])


def gateway_plan(variant=None):
    """(this gateway host's plan in front of every rig the run deploys, or None; every problem)."""
    fl = the_fleet(variant)
    for rig, problem in fl.left_out().items():
        warn(f"the gateway leaves {rig} out: {problem}")
    data = host_data(host.data)
    problems = rigforge.knobs.gateway.validate(data) + schema.boolean(data, "rigforge_manage_services")
    return (None, problems) if problems else gateway.build(host.name, data, fl.rigs())


def front_and_watch_the_fleet(variant=None) -> bool:
    """The fleet gateway on a host of the group `gateway`, Prometheus on one of `monitor`; False: one was refused."""
    data = host_data(host.data)
    if GATEWAY in host.groups:
        gw, problems = gateway_plan(variant)
        if refused(problems, "the gateway"):
            return False
        gateway_role.apply(gw, data["rigforge_manage_services"])
    if MONITOR in host.groups:
        if refused(rigforge.knobs.monitor.validate(data), "the monitor"):
            return False
        monitor_role.server(dict(the_fleet(variant).targets), data, data["rigforge_manage_services"])
    return True


def _weights_state(plan: Plan, asset) -> dict:
    return host.get_fact(
        WeightsState, dest=plan.layout.asset_dir(asset.dir), staging=plan.layout.weights_staging(asset.name)
    )


def prepare(variant=None) -> Plan | None:
    """This host's plan, or None once its refusal naming every problem is queued; `variant`: a name, None, an object."""
    gpus = gpu_count(host.get_fact(NvidiaGpus), host.get_fact(NvidiaPciGpus))  # a card off the bus still counts
    fl, cap_units = the_fleet(variant), tuple(host.get_fact(PowerCapUnits))
    rebuild = lambda count: plan_for(host.name, host.data, variant, count, cap_units=cap_units)  # noqa: E731
    plan, problems = fl.completed(host.name, gpus, cap_units, rebuild)
    stale = verdict.stale_weights
    gated = [a.pin for a in plan.assets if a.pin.gated and stale(a.pin, _weights_state(plan, a))] if plan else []
    token = []  # the HF token's problems: asked of the hub, or missing for gated weights
    if gated and not plan.token:
        token.append(
            f"{', '.join(p.repo for p in gated)} {'is' if len(gated) == 1 else 'are'} gated, not yet fetched, and no "
            "HF token is set: set host data hf_token or RIGFORGE_HF_TOKEN / HF_TOKEN on the controller"
        )
    for pin in gated if gated and plan.token else ():
        problem, warning = token_refused(plan.data["hf_endpoint"], pin, plan.token)
        token += [problem] if problem else []
        if warning:
            warn(warning)
    if not (problems or token):
        return plan
    # the refusal's name says the host data's problems and the HF token's apart: a token the hub refused is never
    # counted as a problem 'in host data'
    parts = [f"{len(problems)} problem(s) in host data"] if problems else []
    name = " and ".join(parts + (["no usable HF token for the gated weights"] if token else []))
    refuse_now(f"Refuse {host.name}: {name}", format_problems(host.name, problems + token, what="rigforge refused"))


def power_warnings(plan: Plan) -> None:
    """Caps outside what the recipe repo measured (not refused), said once preflight passed."""
    known = bool(host.get_fact(NvidiaGpus))  # preflight checked the caps against the cards' own range
    kept = "kept as set" if known else "kept as set if the cards' own range allows it (checked once the driver answers)"
    for warning in power.warnings(plan.caps, power.locate_profile(plan.lock), kept):
        warn(f"WARNING: {warning}")
    if psu := power.psu_warning(plan.caps, plan.data.get("gpu_psu_watts")):  # the sum over every card
        warn(f"WARNING: {psu}")


def image_problems(plan: Plan, variant=None) -> list[str]:
    """The refusal when the rig lacks its image and no source has it (rigforge/obtain.py), asked from the controller."""
    if not plan.data["rigforge_manage_services"] or host.get_fact(DockerImagePresent, image=plan.image):
        return []
    reg = the_fleet(variant).registry
    found = obtain.sources(plan.image, reg, plan.data["serving_image_upstream"], plan.data["serving_image_upstream_ca"])
    if warning := obtain.unasked(plan.image, found):
        warn(f"WARNING: {warning}")
    problem = obtain.problem(plan.image, found, plan.variant.successor)
    return [problem] if problem else []


def needs(plan: Plan) -> Needs:
    """What the variant needs of the rig; its disk: the bytes still to land on the model disk (weights, image)."""
    v = plan.variant
    cuda = plan.lock.image_cuda(plan.image) if plan.lock else None
    disk = sum(asset.bytes for asset in plan.assets if verdict.stale_weights(asset.pin, _weights_state(plan, asset)))
    if plan.data["rigforge_manage_services"] and not host.get_fact(DockerImagePresent, image=plan.image):
        disk += int(IMAGE_GB * 1e9)
    extra = getattr(getattr(v, "recipe", None), "extra", None) or {}  # a slug's registry keys (seeds have none)
    return Needs(
        v.name,
        v.gpus,
        v.min_card_mib,
        v.uses_dflash,
        plan.layout.models,
        disk,
        plan.image,
        cuda,
        nvlink=extra.get("requires_nvlink") is True,
        homogeneous=extra.get("requires_homogeneous_arch") is True,
    )


def hold_the_rig() -> bool:
    """Take the rig's lock for this run (roles/rig_lock.py), or refuse the host in one line saying why; True: held."""
    busy = None if rig_lock.over_ssh(host) else sudo_problem(host)  # over SSH the lock finds it, sudo -n
    if not busy and is_rig(host) and (twins := rig_lock.twins(host)):
        machine, key = rig_lock.identity(host)
        refuse_now(
            f"Refuse {host.name}: the same machine as {', '.join(twins)}",
            f"rigforge refused on {host.name}: {' and '.join([host.name, *twins])} are one machine (machine-id "
            f"{machine}, SSH host key {key}): keep one of these names in the inventory; nothing was changed.",
        )
        return False
    if not busy:  # a sudo that asks for a password is refused before anything else: every later step needs sudo
        this = ctx_host.get()
        rig_lock.ask(this)  # asked for already by the deploy file (rig_lock.ask_first) or provision, or now
        busy, note = rig_lock.take(this)
        probe.lock_answer(this)  # the batched probe came back in the same round trip (rigforge/facts/probe.py)
        if note:
            warn(note)
    if busy and busy.startswith("sudo asks "):
        refuse_now(f"Refuse {host.name}: sudo asks for a password", f"rigforge refused on {host.name}: {busy}.")
    elif busy:
        why = "one machine under two names" if " are one machine " in busy else "another run holds it"
        refuse_now(f"Refuse {host.name}: {why}", f"rigforge refused: {busy}; nothing was changed.")
    return not busy


@deploy("rigforge site", data_defaults=DEFAULTS)
def provision(variant_name: str | None = None):
    probe.install_all()  # one batched probe per rig, cheaper per-op work (rigforge/facts/probe.py); first
    interrupt.install(ctx_state.get())  # Ctrl-C / SIGTERM exit non-zero, naming the cut operation
    rig_lock.ask(ctx_host.get())  # unless the deploy file did, before the roles loaded
    the_fleet(variant_name)  # built while the rig takes its lock and runs its probe
    if not (hold_the_rig() and front_and_watch_the_fleet(variant_name)):
        return
    if not serve_the_registry(variant_name) or not is_rig(host) or (plan := prepare(variant_name)) is None:
        return
    host_needs = needs(plan)
    asked = preflight.remote_problems(plan, _weights_state)  # the remote sources this run fetches from, once
    found = image_problems(plan, variant_name)  # then the data roots inside Docker's (the rig's daemon.json)
    found += roots_inside(plan.layout, data_root_of(host.get_fact(FileContents, path=DAEMON_JSON))) + asked
    if not preflight.check(host_needs, plan.data, found):
        return
    power_warnings(plan)
    recorded = host.get_fact(JsonFile, path=plan.layout.rig_json)
    for warning in changed_roots(plan.layout, recorded, lambda path: host.get_fact(TreeSize, path=path)):
        warn(f"WARNING: {warning}")  # after preflight: no warning comes before a refusal
    if not host.get_fact(NvidiaGpus):  # a fresh rig: say it before the driver goes on
        warn(
            "no NVIDIA driver answers yet: the cards' VRAM and power range are checked right after the driver is "
            "installed, before anything else; a refusal then lists what this run installed"
        )
    wait = int(plan.data["apt_lock_wait"])
    sudo = {key: host.data.get(key) for key in ("_sudo", "_sudo_user") if host.data.get(key)}
    aptlock.free(name=f"Wait for the apt/dpkg lock another process holds (up to {wait} s)", wait=wait, sudo=sudo)
    recover.packages(name="Repair packages an interrupted run left half-installed (dpkg --configure -a)")
    recover.uploads_cleared(name="Remove uploads an interrupted run left in the upload dir")
    nvidia_driver.install(plan)
    gpus_fit(
        name=f"Check the GPUs now that the driver answers ({plan.variant.gpus}x {plan.variant.min_card_mib} MiB)",
        needs=host_needs,
        caps=dict(plan.caps),
        data=dict(plan.data),
    )
    docker_engine.install(plan)
    trust_the_registry(plan, the_fleet(variant_name))
    gpu_power.apply(plan)
    sources.apply(plan)
    weights.apply(plan)
    gateways = {h.name: bool(h.data.get("_sudo")) for h in host.inventory.get_group(GATEWAY, default=[])}
    serving.apply(plan, gateways, sudo=bool(host.data.get("_sudo")))
    # last: the collector's declared facts (variant, image, rest) follow a serving change only once its gate passed
    monitor_role.rig(plan)


def load_saved_images() -> None:
    """deploy/images_load.py: host data's rigforge_images_dir onto this host (roles/images.py), or refuse it."""
    data = host_data(host.data)
    problems = rigforge.knobs.images.validate(data)
    try:  # the directory is read only once the keys are valid
        saved = [] if problems else images.check_loadable(data["rigforge_images_dir"])
    except images.ImagesError as error:
        problems.append(str(error))
    if problems:
        refuse_now(f"Refuse {host.name}: cannot load images", f"rigforge refused {host.name}: {'; '.join(problems)}")
    elif hold_the_rig():
        layout = HostLayout(root=data["rigforge_root"]) if data["rigforge_root"] else HostLayout()
        images_role.load(data["rigforge_images_dir"], saved, layout, data["images_port"], REGISTRY in host.groups)
