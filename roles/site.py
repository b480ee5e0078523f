"""The roles of one host in order (`provision`): the fleet's own hosts' roles, then a rig's plan
(rigforge/model/fleet.py) and its roles, which read only the plan. Any problem refuses a host in one message, its first
operation, so nothing changes.
"""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import FileContents

import rigforge.model.knobs.gateway
import rigforge.model.knobs.images
import rigforge.model.knobs.monitor
from rigforge.layout import DAEMON_JSON, HostLayout
from rigforge.model import fleet, gateway, power, registry, saved_images, schema
from rigforge.model.fleet import GATEWAY, MONITOR, REGISTRY, Plan, PlannedAsset, is_rig
from rigforge.model.hardware import changed_roots, data_root_of, format_problems, gpu_count, roots_inside
from rigforge.model.knobs.images import Images
from rigforge.model.knobs.serving import Serving
from rigforge.observe import obtain, refusals
from rigforge.observe.facts import probe
from rigforge.observe.facts.docker import DockerImagePresent
from rigforge.observe.facts.files import JsonFile, TreeSize
from rigforge.observe.facts.hfweights import WeightsState
from rigforge.observe.facts.nvidia import NvidiaGpus, NvidiaPciGpus, PowerCapUnits
from rigforge.observe.inventory import sudo_problem
from roles import docker_engine, gpu_power, interrupt, nvidia_driver, preflight, rig_lock, serving, sources, weights
from roles import gateway as gateway_role
from roles import images as images_role
from roles import monitor as monitor_role
from roles import registry as registry_role
from roles.operations import aptlock, recover
from roles.operations.checks import gpus_fit, refuse_now
from roles.operations.shown import warn


def the_fleet(variant: str | None = None) -> fleet.Fleet:
    """This run's fleet for `variant` (rigforge/model/fleet.py; None: each rig's host data names its own), built once on
    the controller at the first host's turn; a deploy file passes it to `provision`."""
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


def serve_the_registry(fl: fleet.Fleet) -> bool:
    """On the fleet registry's host, the registry (roles/registry.py); False when it was refused (that host only)."""
    if host.name != fl.registry_host:
        return True
    reg, problems = fl.registry, list(fl.registry_problems)
    tls, ca = None, None
    if not problems:
        tls, ca, problems = registry.certificates(reg)
    if not refused(problems, "the fleet registry"):
        manage = fl.knobs(host.name).serving.rigforge_manage_services
        registry_role.serve(reg, tls, manage, ca, fl.images)
    return not problems


def trust_the_registry(plan: Plan, fl: fleet.Fleet) -> None:
    """On a rig, trust the fleet registry; one refused on its own host is only a warning here."""
    reg, problems, ca = fl.registry, list(fl.registry_problems), None
    if reg is not None and not problems:
        _, ca, problems = registry.certificates(reg, server=False)
        reg = None if problems else reg
    if problems:
        warn(f"the fleet registry on {fl.registry_host} is left out (that host is refused): {problems[0]}")
    if reg is not None:
        registry_role.trust(reg, ca, plan.layout.daemon_json, plan.knobs.serving.rigforge_manage_services)


def gateway_plan(fl: fleet.Fleet) -> tuple[gateway.GatewayPlan | None, list[str]]:
    """(this gateway host's plan in front of every rig the run deploys, or None; every problem)."""
    for rig, problem in fl.left_out().items():
        warn(f"the gateway leaves {rig} out: {problem}")
    data = fl.data(host.name)
    problems = rigforge.model.knobs.gateway.validate(data) + schema.boolean(data, "rigforge_manage_services")
    return (None, problems) if problems else gateway.build(host.name, fl.knobs(host.name).gateway, fl.rigs())


def front_and_watch_the_fleet(fl: fleet.Fleet) -> bool:
    """The fleet gateway on a host of the group `gateway`, Prometheus on one of `monitor`; False: one was refused."""
    if GATEWAY in host.groups:
        gw, problems = gateway_plan(fl)
        if refused(problems, "the gateway"):
            return False
        gateway_role.apply(gw, fl.knobs(host.name).serving.rigforge_manage_services)
    if MONITOR in host.groups:
        if refused(rigforge.model.knobs.monitor.validate(fl.data(host.name)), "the monitor"):
            return False
        knobs = fl.knobs(host.name)
        monitor_role.server(dict(fl.targets), knobs.monitor, knobs.serving.rigforge_manage_services)
    return True


def weights_states(plan: Plan) -> dict[str, dict]:
    """{asset name: WeightsState}: each of the plan's weights assets as the rig holds it."""
    layout = plan.layout
    states = {}
    for asset in plan.assets:
        dest, staging = layout.asset_dir(asset.dir), layout.weights_staging(asset.name)
        states[asset.name] = host.get_fact(WeightsState, dest=dest, staging=staging)
    return states


def token_problems(plan: Plan, fetched: list[PlannedAsset]) -> list[str]:
    """The HF token's problems for the gated weights this run fetches: missing (refusals.token_missing), or refused
    by the hub, asked once per gated repo; a hub that cannot be asked is a warning."""
    gated = refusals.gated(fetched)
    missing = refusals.token_missing(plan, gated)
    if missing or not gated:
        return missing
    problems = []
    for pin in gated:
        problem, warning = obtain.token_refused(plan.knobs.weights.hf_endpoint, pin, plan.token)
        if problem:
            problems.append(problem)
        if warning:
            warn(warning)
    return problems


def prepare(fl: fleet.Fleet) -> Plan | None:
    """This host's plan (`fl`'s, for the cards its probe shows), or None once its refusal naming every problem is
    queued: the host data's, and the HF token's for gated weights still to fetch."""
    gpus = gpu_count(host.get_fact(NvidiaGpus), host.get_fact(NvidiaPciGpus))  # a card off the bus still counts
    plan, problems = fl.completed(host.name, gpus, tuple(host.get_fact(PowerCapUnits)))
    token = token_problems(plan, refusals.to_fetch(plan, weights_states(plan))) if plan else []
    if not (problems or token):
        return plan
    # the refusal's name says the host data's problems and the HF token's apart: a token the hub refused is never
    # counted as a problem 'in host data'
    parts = [f"{len(problems)} problem(s) in host data"] if problems else []
    name = " and ".join(parts + (["no usable HF token for the gated weights"] if token else []))
    refuse_now(f"Refuse {host.name}: {name}", format_problems(host.name, problems + token, what="rigforge refused"))
    return None


def power_warnings(plan: Plan) -> None:
    """Caps outside what the recipe repo measured (not refused), said once preflight passed."""
    known = bool(host.get_fact(NvidiaGpus))  # preflight checked the caps against the cards' own range
    kept = "kept as set" if known else "kept as set if the cards' own range allows it (checked once the driver answers)"
    for warning in power.warnings(plan.caps, power.locate_profile(plan.lock), kept):
        warn(f"WARNING: {warning}")
    psu = power.psu_warning(plan.caps, plan.knobs.gpu_power.gpu_psu_watts)  # the sum over every card
    if psu:
        warn(f"WARNING: {psu}")


def image_problems(plan: Plan, fl: fleet.Fleet, image_present: bool) -> list[str]:
    """The refusal when the rig lacks its image and no source has it, the sources asked from the controller
    (rigforge/observe/obtain.py; refusals.image_refusal decides)."""
    if not refusals.lacks_image(plan, image_present):
        return []
    knobs = plan.knobs.serving
    found = obtain.sources(
        plan.locked_image, fl.registry, knobs.serving_image_upstream, knobs.serving_image_upstream_ca
    )
    problems, warnings = refusals.image_refusal(plan, found)
    for warning in warnings:
        warn(f"WARNING: {warning}")
    return problems


def refuse_sudo(problem: str) -> None:
    """Refuse this host in one line: its sudo asks for a password (`problem`, inventory.sudo_password_problem)."""
    refuse_now(f"Refuse {host.name}: sudo asks for a password", f"rigforge refused on {host.name}: {problem}.")


def sudo_refused() -> bool:
    """Refuse this host when its sudo asks for a password host data does not give (asked with `sudo -n`): before
    anything else, every later step needs sudo. Over SSH the lock's own request finds it (`hold_the_rig`), so it is
    not asked here. True: refused."""
    if rig_lock.over_ssh(host):
        return False
    problem = sudo_problem(host)
    if problem is None:
        return False
    refuse_sudo(problem)
    return True


def twins_refused() -> bool:
    """Refuse a rig that is the same machine as other names in the inventory (machine-id and SSH host key), naming
    them; nothing is changed on it. True: refused."""
    if not is_rig(host):
        return False
    twins = rig_lock.twins(host)
    if not twins:
        return False
    machine, key = rig_lock.identity(host)
    refuse_now(
        f"Refuse {host.name}: the same machine as {', '.join(twins)}",
        f"rigforge refused on {host.name}: {' and '.join([host.name, *twins])} are one machine (machine-id "
        f"{machine}, SSH host key {key}): keep one of these names in the inventory; nothing was changed.",
    )
    return True


def hold_the_rig() -> bool:
    """Take the rig's lock for this run (roles/rig_lock.py), or refuse the host in one line saying why: its sudo asks
    for a password, it is the same machine as other names, or another run holds the lock. True: held."""
    if sudo_refused() or twins_refused():
        return False
    this = ctx_host.get()
    rig_lock.ask(this)  # asked for already by the deploy file (rig_lock.ask_first) or provision, or now
    busy, note = rig_lock.take(this)  # None: held; else the lock's answer, naming who holds it
    probe.lock_answer(this)  # the batched probe came back in the same round trip (rigforge/observe/facts/probe.py)
    if note:
        warn(note)
    if busy is None:
        return True
    if busy.startswith("sudo asks "):  # over SSH, the lock's `sudo -n` was refused: nothing ran as root
        refuse_sudo(busy)
    else:
        why = "one machine under two names" if " are one machine " in busy else "another run holds it"
        refuse_now(f"Refuse {host.name}: {why}", f"rigforge refused: {busy}; nothing was changed.")
    return False


def start() -> None:
    """What every run does first on a host, before the fleet is built: the batched probe installed (one per rig,
    cheaper per-op work: rigforge/observe/facts/probe.py), Ctrl-C / SIGTERM made to exit non-zero naming the cut
    operation, and the rig's lock asked for (unless the deploy file did, before the roles loaded)."""
    probe.install_all()
    interrupt.install(ctx_state.get())
    rig_lock.ask(ctx_host.get())


def provision_variant(variant_name: str | None = None) -> None:
    """`provision` this run's fleet for `variant_name` (None: each rig's host data names its own): the deploy files'
    one line. The fleet is built while the rig takes its lock and runs its probe (the deploy file asked for both
    before the roles loaded: rig_lock.ask_first)."""
    provision(the_fleet(variant_name))


@deploy("rigforge site")
def provision(fl: fleet.Fleet) -> None:
    """This host's part of the fleet `fl`: its lock, the fleet's own hosts' roles (gateway, monitor, registry), then a
    rig's preflight and roles in order. Every refusal comes before the first change."""
    start()
    if not (hold_the_rig() and front_and_watch_the_fleet(fl)):
        return
    if not serve_the_registry(fl) or not is_rig(host):
        return
    plan = prepare(fl)
    if plan is None:
        return
    weights_now = weights_states(plan)
    image_present = bool(host.get_fact(DockerImagePresent, image=plan.image))
    host_needs = refusals.needs(plan, refusals.to_fetch(plan, weights_now), image_present)
    asked = preflight.remote_problems(plan, weights_now)  # the remote sources this run fetches from, once
    found = image_problems(plan, fl, image_present)  # then the data roots inside Docker's (the rig's daemon.json)
    found += roots_inside(plan.layout, data_root_of(host.get_fact(FileContents, path=DAEMON_JSON))) + asked
    if not preflight.check(host_needs, plan.knobs, plan.settings, found):
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
    wait = plan.knobs.driver.apt_lock_wait
    sudo = dict(fl.sudo[host.name])
    aptlock.free(name=f"Wait for the apt/dpkg lock another process holds (up to {wait} s)", wait=wait, sudo=sudo)
    recover.packages(name="Repair packages an interrupted run left half-installed (dpkg --configure -a)")
    recover.uploads_cleared(name="Remove uploads an interrupted run left in the upload dir")
    nvidia_driver.install(plan)
    gpus_fit(
        name=f"Check the GPUs now that the driver answers ({plan.variant.gpus}x {plan.variant.min_card_mib} MiB)",
        needs=host_needs,
        caps=dict(plan.caps),
        power=plan.knobs.gpu_power,
        settings=plan.settings,
    )
    docker_engine.install(plan)
    trust_the_registry(plan, fl)
    gpu_power.apply(plan)
    sources.apply(plan)
    weights.apply(plan)
    gateways = fl.gateway_hosts()
    serving.apply(plan, gateways, sudo=bool(sudo.get("_sudo")))
    # last: the collector's declared facts (variant, image, rest) follow a serving change only once its gate passed
    monitor_role.rig(plan)


def load_saved_images() -> None:
    """deploy/images_load.py: host data's rigforge_images_dir onto this host (roles/images.py), or refuse it."""
    data = fleet.data_of(host)
    problems = rigforge.model.knobs.images.validate(data)
    wanted, root = Images.of(data), Serving.of(data).rigforge_root  # typed once the keys are checked
    try:  # the directory is read only once the keys are valid
        saved = [] if problems else saved_images.check_loadable(wanted.rigforge_images_dir)
    except saved_images.ImagesError as error:
        problems.append(str(error))
    if problems:
        refuse_now(f"Refuse {host.name}: cannot load images", f"rigforge refused {host.name}: {'; '.join(problems)}")
        return
    if not hold_the_rig():
        return
    layout = HostLayout(root=root) if root else HostLayout()
    images_role.load(wanted.rigforge_images_dir, saved, layout, wanted.images_port, REGISTRY in host.groups)
