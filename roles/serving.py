"""Serving: the variant's vLLM unit, one enabled instance, its health gate and rig.json. With
rigforge_manage_services false (the testbed: no systemd in a chroot) nothing is started, pulled or health-checked.
"""

from collections.abc import Mapping
from datetime import UTC, datetime

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import files, systemd
from pyinfra.operations.util import any_changed

from rigforge.layout import SERVE_FILES
from rigforge.model.fleet import Plan
from rigforge.model.render import VLLM_UNIT
from rigforge.observe.facts.system import EnabledInstances
from roles.operations import gateway
from roles.operations import serving as ops
from roles.operations.staged import staged_files, systemd_verify


@deploy("Serve the variant with vLLM")
def apply(plan: Plan, gateways: Mapping[str, bool] | None = None, sudo: bool = False) -> None:
    """`gateways`: the fleet gateway hosts this rig leaves while its unit restarts ({name: use sudo}); `sudo`:
    whether this rig's own commands run with sudo."""
    layout = plan.layout
    knobs = plan.knobs.serving
    manage, rest, unit = knobs.rigforge_manage_services, knobs.serving_rest, layout.vllm_unit

    for cache_dir in ("torch_compile", "triton"):
        files.directory(name=f"Compile cache {cache_dir}", path=f"{layout.cache}/{cache_dir}", mode="755")

    compose = staged_files(
        name=f"Install {plan.variant.name} compose file and .env (validated by docker compose config)",
        dest=layout.serve_dir,
        files={name: (plan.files[name], mode) for name, mode in SERVE_FILES.items() if name in plan.files},
        validate="docker compose config -q",
    )
    unit_file = staged_files(
        name=f"Install {VLLM_UNIT} (validated by systemd-analyze verify)",
        dest=layout.unit_dir,
        files={VLLM_UNIT: (plan.files[VLLM_UNIT], "644")},
        validate=systemd_verify(VLLM_UNIT, instance=unit),
        keep_previous=False,
    )

    enabled = host.get_fact(EnabledInstances, unit_dir=layout.unit_dir, template=layout.vllm_template)
    previous = [u for u in enabled if u != unit]
    if manage:
        ops.image_present(name=f"Pull {plan.image} ahead of the restart", image=plan.image)
        systemd.daemon_reload(name="Reload systemd units", _if=unit_file.did_change)
    changed = any_changed(compose, unit_file)

    def restarts() -> bool:  # the switch below stops the previous instance, or the unit (re)starts
        return bool(previous) or unit not in enabled or changed() or ops.start_reason(plan, False) is not None

    if manage and gateways:  # before the switch below stops the previous instance
        gateway.drained(
            name=f"Drain {host.name} at the fleet gateway before the restart",
            plan=plan,
            gateways=gateways,
            _if=lambda: not rest and restarts(),
        )
    if manage and gateways and rest:  # drained on purpose, before a resting unit stops
        gateway.drained(
            name=f"Keep {host.name} drained at the fleet gateway (serving_rest: {rest})",
            plan=plan,
            gateways=gateways,
            held=True,
        )
    switched = ops.sole_instance(
        name=f"Enable {unit} as the only vLLM instance" if rest != "stopped" else f"Disable {unit}: resting stopped",
        plan=plan,
    )
    if not manage:
        host.noop(f"services not managed on this host: {unit} enabled but not started, no health gate")
    elif rest == "stopped":
        ops.stopped(name=f"Keep {unit} stopped (serving_rest: stopped)", unit=unit)
    else:
        restart = any_changed(compose, unit_file, switched)  # the health gate's: what it may roll back
        started = ops.running(
            name=f"Run {unit}", plan=plan, changed=any_changed(compose, unit_file), enabled=any_changed(switched)
        )
        gate = ops.healthy(
            name=f"Health gate: {getattr(plan.variant, 'health_path', '/v1/models')} and one chat completion on port "
            f"{plan.port}",
            plan=plan,
            rollback_unit=previous[0] if previous else None,
            started=started,
            changed=restart,
            _ignore_errors=bool(gateways),  # the rejoin below brings a rolled-back rig back, then fails the host
        )
        if gateways and rest is None:
            gateway.rejoined(
                name=f"Rejoin the fleet gateway on port {plan.port}", plan=plan, gateways=gateways, gate=gate, sudo=sudo
            )

    now = datetime.now(UTC).isoformat(timespec="seconds")
    ops.manifest(name=f"Record {layout.rig_json}", plan=plan, now=now, rest=rest)
