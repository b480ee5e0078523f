import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import driver_table, schema
from rigforge.model.knobs import Knobs, defaults_of


@dataclass(frozen=True)
class NvidiaDriver(Knobs):
    """The NVIDIA driver and the apt state around it (roles/nvidia_driver.py)."""

    # cuda (NVIDIA's CUDA repo) or ubuntu (Ubuntu's archive, prebuilt signed modules)
    nvidia_driver_source: str = "cuda"
    nvidia_driver_manage: bool = True  # false: leave an existing driver alone, only check its branch
    nvidia_driver_branch: int = 580  # driver branch (580 or later)
    nvidia_driver_flavor: str = "open"  # open (open kernel modules) or proprietary
    nvidia_driver_kernel_flavour: str = "generic"  # source ubuntu: linux-modules-nvidia-<branch>-open-<this>
    nvidia_driver_repo_url: str | None = None  # flat apt repo (Suites: /); default NVIDIA's CUDA repo for the OS
    nvidia_driver_repo_key_url: str | None = None  # armored repo key; default <repo url><8793F200|3bf863cc>.pub
    # default NVIDIA's fingerprint for the OS; a differing key is refused
    nvidia_driver_repo_key_fingerprint: str | None = None
    nvidia_driver_repo_key_sha256: str | None = None  # pin the key file's sha256 too (checked after download)
    nvidia_allow_reboot: bool = False  # reboot the rig when the installed driver is not the running one
    apt_adopt_sources: bool = True  # replace other source files for the same URI (kept as *.rigforge-bak)
    apt_lock_wait: int = 300  # seconds to wait, before the first change, for an apt/dpkg lock another process holds


DEFAULTS = defaults_of(NvidiaDriver)
KERNEL_FLAVOUR = re.compile(r"([^\W_]|[-.])+")  # letters, digits (str.isalnum), - and .


def validate(data: Mapping) -> list[str]:
    problems = schema.choice(data, "nvidia_driver_source", driver_table.SOURCES, deploy=True)
    problems += schema.choice(data, "nvidia_driver_flavor", driver_table.FLAVORS, deploy=True)
    branch = data["nvidia_driver_branch"]
    if isinstance(branch, bool) or not str(branch).isdigit() or int(branch) < driver_table.MIN_BRANCH:
        problems.append(f"nvidia_driver_branch={branch!r} must be a branch number, 580 or later (e.g. 580, 590).")
    for key in ("nvidia_driver_manage", "nvidia_allow_reboot", "apt_adopt_sources"):
        problems += schema.boolean(data, key, deploy=True)
    problems += schema.integer(data, "apt_lock_wait", 0, 86400, " of seconds")
    problems += schema.matches(
        data,
        "nvidia_driver_repo_key_fingerprint",
        schema.FINGERPRINT,
        what="a 40-hex-digit key fingerprint",
        optional=True,
        deploy=True,
    )
    problems += schema.matches(
        data, "nvidia_driver_kernel_flavour", KERNEL_FLAVOUR, what="a kernel flavour such as generic", deploy=True
    )
    return problems
