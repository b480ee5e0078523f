"""systemd unit operations that also work where systemd is not running (a chroot on the testbed)."""

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from rigforge.facts.system import SystemdUnitEnabled
from roles.operations.shown import unchanged


@operation()
def enabled(unit: str):
    """``systemctl enable UNIT`` unless ``systemctl is-enabled`` already says so (pyinfra's systemd.service
    asks ``systemctl show``, which a chroot ignores, so it would re-enable on every run).

    + unit: the unit's name, e.g. ``name.service``
    """
    if unchanged(host.get_fact(SystemdUnitEnabled, unit=unit), f"{unit} is enabled"):
        return
    yield StringCommand("systemctl", "enable", QuoteString(unit))
