"""rigforge testbed: simulated rigs (Debian 13 chroots behind real sshds) with local apt, git and HF stand-ins.

from rigforge.testbed import RigSpec, Testbed, up, down, tools_rootfs
tb = up(dir=Path("/var/lib/rigforge-testbed"), specs=[RigSpec(), RigSpec(gpus=1)])
tb.inventory  # pyinfra inventory;  tb.rig("rig1").run("nvidia-smi -L")
down(tb.dir)
"""

from ._util import TestbedError
from .core import DEFAULT_DIR, Testbed, down, load, up
from .rig import Rig, RigSpec
from .rootfs import tools_rootfs

__all__ = ["DEFAULT_DIR", "Rig", "RigSpec", "Testbed", "TestbedError", "down", "load", "tools_rootfs", "up"]
