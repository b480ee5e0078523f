"""Monitoring (docs/monitoring.md): on a rig (`rig`), Debian's prometheus-node-exporter and rigforge's GPU textfile
collector (a 15 s systemd timer); on the monitor host (`server`), Debian's prometheus scraping the Fleet's targets.
"""

from collections.abc import Mapping
from io import StringIO

from pyinfra.api import deploy
from pyinfra.operations import apt, files, systemd

from rigforge.layout import GPU_METRICS_SCRIPT, MONITOR_CONFIG, MONITOR_DEFAULTS, MONITOR_RULES, NODE_EXPORTER_PACKAGE
from rigforge.model import monitor
from rigforge.model.fleet import Plan
from rigforge.model.knobs.monitor import Monitor
from rigforge.model.render import gpu_metrics_units, render_gpu_metrics
from roles.operations import systemd_units
from roles.operations.staged import staged_files


@deploy("Rig metrics")
def rig(plan: Plan) -> None:
    layout = plan.layout
    # dbus: the exporter's systemd collector (the vLLM unit's state) asks systemd over the system bus
    apt.packages(
        name=f"Install {NODE_EXPORTER_PACKAGE} (Debian's) and dbus for its systemd collector",
        packages=[NODE_EXPORTER_PACKAGE, "dbus"],
        no_recommends=True,
    )
    collector = render_gpu_metrics(plan.caps, plan.variant.name, plan.image, rest=plan.knobs.serving.serving_rest)
    units = gpu_metrics_units(layout)
    systemd_units.script_and_units(
        layout, GPU_METRICS_SCRIPT, collector, "the GPU textfile collector", units, enable=[layout.gpu_metrics_timer]
    )
    if plan.knobs.serving.rigforge_manage_services:
        # dbus.socket is static (sockets.target wants it at boot): a bus installed just now is started here
        systemd.service(name="Run the system bus (dbus.socket)", service="dbus.socket", running=True)
        systemd.service(name=f"Run {NODE_EXPORTER_PACKAGE}", service=NODE_EXPORTER_PACKAGE, running=True)
        # the timer runs the collector as it starts and every 15 s after, a changed script at its next tick: the
        # run never starts the collector itself (a collector that fails is the stale-metrics alert's, not the run's)
        systemd.service(name=f"Run {layout.gpu_metrics_timer}", service=layout.gpu_metrics_timer, running=True)


@deploy("Monitor")
def server(targets: Mapping[str, tuple[tuple[str, str], ...]], knobs: Monitor, manage_services: bool) -> None:
    """`targets`: the Fleet's (rigforge/model/fleet.py); `knobs`: this host's (rigforge/model/knobs/monitor.py)."""
    apt.packages(name="Install prometheus (Debian's)", packages=["prometheus"], no_recommends=True)
    config_dir, config = MONITOR_CONFIG.rsplit("/", 1)
    rules = MONITOR_RULES.rsplit("/", 1)[1]
    count = sum(len(t) for t in targets.values())
    staged = staged_files(
        name=f"Install {MONITOR_CONFIG} ({count} targets from the fleet) and the alerting rules (checked by promtool)",
        dest=config_dir,
        files={config: (monitor.render_config(targets, knobs), "644"), rules: (monitor.rules(), "644")},
        validate=f"promtool check rules {rules} && promtool check config {config}",
    )
    args = files.put(
        name=f"Size Prometheus's storage in {MONITOR_DEFAULTS} ({monitor.args(knobs)})",
        src=StringIO(f'# rigforge (roles/monitor.py): rewritten by every run\nARGS="{monitor.args(knobs)}"\n'),
        dest=MONITOR_DEFAULTS,
        mode="644",
    )
    if manage_services:
        systemd_units.running(
            "prometheus",
            at_boot=True,
            reloaded=("Reload prometheus (config or rules changed)", staged.did_change),
            restarted=("Restart prometheus (its storage flags changed)", args.did_change),
        )
    for dest, pages in monitor.consoles().items():  # read on every request: no reload
        staged_files(
            name=f"Install {', '.join(pages)} in {dest} (the fleet page: /consoles/rigforge-fleet.html)",
            dest=dest,
            files={name: (text, "644") for name, text in pages.items()},
            keep_previous=False,
        )
