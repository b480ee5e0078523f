"""systemd units: an enable that works without a running systemd (the testbed's chroot), the roles' unit sequences."""

from collections.abc import Callable, Iterable

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import systemd

from rigforge.layout import HostLayout
from rigforge.observe import verdict
from rigforge.observe.facts.system import SystemdUnitEnabled
from roles.operations.shown import Commands, unchanged
from roles.operations.staged import staged_files, systemd_verify


@operation()
def enabled(unit: str) -> Commands:
    """``systemctl enable UNIT`` unless ``systemctl is-enabled`` already says so (pyinfra's systemd.service
    asks ``systemctl show``, which a chroot ignores, so it would re-enable on every run).

    + unit: the unit's name, e.g. ``name.service``

    **Example:**

    .. code:: python

        from roles.operations import systemd_units
        systemd_units.enabled(
            name="Enable rigforge-gpu-power.service at boot",
            unit="rigforge-gpu-power.service",
        )
    """
    problems = verdict.unit_enabled(unit, host.get_fact(SystemdUnitEnabled, unit=unit))
    if unchanged(not problems, f"{unit} is enabled"):
        return
    yield StringCommand("systemctl", "enable", QuoteString(unit))


@operation()
def disabled(unit: str) -> Commands:
    """``systemctl disable --now UNIT`` when ``systemctl is-enabled`` says it is enabled (`verdict.unit_enabled`,
    declared disabled: the same answer status gives).

    + unit: the unit's name, e.g. ``name.timer``

    **Example:**

    .. code:: python

        from roles.operations import systemd_units
        systemd_units.disabled(name="Stop and disable the cap hold", unit="rigforge-gpu-hold.timer")
    """
    problems = verdict.unit_enabled(unit, host.get_fact(SystemdUnitEnabled, unit=unit), declared=False)
    if unchanged(not problems, f"{unit} is disabled"):
        return
    yield StringCommand("systemctl", "disable", "--now", QuoteString(unit))


def script_and_units(
    layout: HostLayout, script: str, text: str, what: str, units: dict[str, str], enable: Iterable[str]
) -> tuple[OperationMeta, OperationMeta]:
    """`script` in libexec (sh -n) and `units` {name: text} (systemd-analyze verify), systemd reloaded when they
    changed, `enable` enabled at boot; returns the script's and the units' install operations."""
    shipped = staged_files(
        name=f"Install {layout.libexec}/{script} ({what})",
        dest=layout.libexec,
        files={script: (text, "755")},
        validate=f"sh -n {script}",
        keep_previous=False,
    )
    installed = staged_files(
        name=f"Install {' and '.join(units)} (validated by systemd-analyze verify)",
        dest=layout.unit_dir,
        files={name: (text, "644") for name, text in units.items()},
        validate=" && ".join(f"( {systemd_verify(name)} )" for name in units),
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=installed.did_change)
    for name in enable:
        enabled(name=f"Enable {name} at boot", unit=name)
    return shipped, installed


def running(unit: str, at_boot: bool | None = None, **changed: tuple[str, Callable[[], bool]]) -> None:
    """Run `unit` (enabled too when `at_boot`), then each of `changed` in order: verb=(operation name, condition)."""
    systemd.service(name=f"Run {unit}", service=unit, running=True, enabled=at_boot)
    for verb, (name, condition) in changed.items():
        systemd.service(name=name, service=unit, _if=condition, **{verb: True})
