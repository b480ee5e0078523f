"""What the driver and container-runtime roles render, checked against the vendors' published instructions.

The expected names below were written from the vendors' pages (cited per test), not from rigforge/model/driver_table.py:
Ubuntu 22.04, Ubuntu 24.04, Debian 12 and Debian 13 x open/proprietary x branch 580/590. The roles run on
pyinfra's fake connector: the commands and files are what a real rig would get.
"""

from __future__ import annotations

import pytest
import yaml
from test_roles_host_ops import checked, converge, executed, op_commands, planned, rig, uploads

import rigforge.model.knobs.docker_engine
import rigforge.model.knobs.nvidia_driver
from rigforge.model import driver_table, fleet
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.packages import TOOLKIT_PACKAGES, PackageSet, toolkit
from rigforge.model.pins import default_lock_path, load_lock
from rigforge.observe.facts.apt import AptSourceFiles, KeyFingerprints, parse_deb822, parse_one_line, same_uri_files
from rigforge.observe.facts.nvidia import NvidiaRunningDriver
from roles import docker_engine, nvidia_driver, preflight
from roles.operations import apt_repo

CUDA = "https://developer.download.nvidia.com/compute/cuda/repos"
OLD_KEY = ("3bf863cc.pub", "EB693B3035CD5710E231E123A4B469963BF863CC")
NEW_KEY = ("8793F200.pub", "02182E60104FCDC26EAE1B8597A5D4CB8793F200")

# (os, flavour, branch) -> (pinning package, packages installed after it, package whose version is the driver's)
# From NVIDIA's Driver Installation Guide (https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/,
# "Debian" / "Ubuntu" sections): "apt install nvidia-driver-pinning-<branch>" first, then "apt install nvidia-open"
# (Open Kernel Modules) or "apt install cuda-drivers" (Proprietary Kernel Modules). Its "Recent updates" page:
# "Starting with branch 590, the Ubuntu packages will be renamed by removing the branch designation"
# (nvidia-dkms-580-open -> nvidia-dkms-open, nvidia-dkms-580 -> nvidia-dkms); branch 580 on Ubuntu keeps the
# branch in the name (nvidia-driver-580-open). Debian's kernel module packages are nvidia-kernel-open-dkms /
# nvidia-kernel-dkms (NVIDIA forum: Debian cuda-drivers "Depends: ... nvidia-kernel-dkms (>= 580.65.06)").
EXPECTED = {}
for _os in ("ubuntu2204", "ubuntu2404"):
    EXPECTED[(_os, "open", 580)] = ("nvidia-driver-pinning-580", ["nvidia-driver-580-open"], "nvidia-dkms-580-open")
    EXPECTED[(_os, "proprietary", 580)] = ("nvidia-driver-pinning-580", ["nvidia-driver-580"], "nvidia-dkms-580")
    EXPECTED[(_os, "open", 590)] = ("nvidia-driver-pinning-590", ["nvidia-open"], "nvidia-dkms-open")
    EXPECTED[(_os, "proprietary", 590)] = ("nvidia-driver-pinning-590", ["cuda-drivers"], "nvidia-dkms")
for _os in ("debian12", "debian13"):
    for _branch in (580, 590):
        EXPECTED[(_os, "open", _branch)] = (
            f"nvidia-driver-pinning-{_branch}",
            ["nvidia-open"],
            "nvidia-kernel-open-dkms",
        )
        EXPECTED[(_os, "proprietary", _branch)] = (
            f"nvidia-driver-pinning-{_branch}",
            ["cuda-drivers"],
            "nvidia-kernel-dkms",
        )


def key_of(os: str) -> tuple[str, str]:
    """NVIDIA/cuda-repo-management issue #39 (https://github.com/NVIDIA/cuda-repo-management/issues/39): "Debian
    13 is signed with the new key (8793F200)"; the Ubuntu 24.04 (and every older) repo is still signed with
    3bf863cc (EB693B3035CD5710E231E123A4B469963BF863CC)."""
    return NEW_KEY if os == "debian13" else OLD_KEY


@pytest.mark.parametrize("os,flavor,branch", sorted(EXPECTED))
def test_cuda_repo_source_key_and_packages(os, flavor, branch):
    """NVIDIA Driver Installation Guide, network repository: the repo is
    https://developer.download.nvidia.com/compute/cuda/repos/<distro>/<arch>/ (flat, "/"), then the pinning
    package, then the driver (https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/)."""
    pinning, install, version_package = EXPECTED[(os, flavor, branch)]
    key_file, fingerprint = key_of(os)
    hosts = {"r": rig(os, gpus=[], nvidia_driver_flavor=flavor, nvidia_driver_branch=branch)}
    files = uploads(converge(hosts, planned(nvidia_driver.install), execute=False), "r")
    assert files["/etc/apt/sources.list.d/rigforge-nvidia-cuda.sources"].splitlines() == [
        "# managed by rigforge",
        "Types: deb",
        f"URIs: {CUDA}/{os}/x86_64/",
        "Suites: /",
        "Signed-By: /etc/apt/keyrings/rigforge-nvidia-cuda.asc",
    ]
    state = converge(hosts, planned(nvidia_driver.install))
    assert not state.failed_hosts
    commands = executed(state, "r")
    (key,) = [c for c in commands if "gpg --batch --show-keys" in c and "install -m 644" in c]
    assert f"{CUDA}/{os}/x86_64/{key_file}" in key and fingerprint in key
    assert "install -m 644" in key and "/etc/apt/keyrings/rigforge-nvidia-cuda.asc" in key
    installs = [c for c in commands if "apt-get" in c and " install " in c and ("nvidia" in c or "cuda-drivers" in c)]
    assert len(installs) == 2, installs
    assert installs[0].split()[-1] == pinning  # the branch lock comes first, alone
    assert installs[1].split()[-len(install) :] == install
    assert not any("apt-key" in c for c in commands)
    # installed: the table's packages, the rest of the driver stack at the driver's version, an unrelated package
    stack = [(name, "580.95.05-1") for name in (*install, version_package, "libcuda1", "libnvidia-ml1")]
    others = [(pinning, f"{branch}-1"), ("nvidia-settings", "525.1-1"), ("ca-certificates", "1"), ("curl", "1")]
    done = converge(
        {"r": rig(os, gpus=[], packages=stack + others, nvidia_driver_flavor=flavor, nvidia_driver_branch=branch)},
        planned(nvidia_driver.install),
        execute=False,
    )
    source = "cuda"
    driver = PackageSet(
        "the driver",
        tuple(install),
        (pinning, *install, version_package),
        held_with=version_package,
        held_prefixes=tuple(driver_table.UNATTENDED_PREFIXES[source]),
    )
    hold = op_commands(done, "r", apt_repo.hold, packages=driver)
    expect = sorted({pinning, *install, version_package, "libcuda1", "libnvidia-ml1"})  # not nvidia-settings
    assert hold == [f"apt-mark hold {' '.join(expect)}"]
    unattended = files["/etc/apt/apt.conf.d/51rigforge-nvidia-unattended-upgrades"]
    assert all(f'"^{name}$";' in unattended for name in (pinning, *install, version_package))


@pytest.mark.parametrize("os", ["debian12", "debian13"])
def test_debian_names_carry_no_branch(os):
    """The issue's finding, from NVIDIA's Debian repositories: there is no nvidia-driver-580-open on Debian."""
    for (target, _, _), (_, install, version_package) in EXPECTED.items():
        if target == os:
            assert not any("580" in name or "590" in name for name in (*install, version_package))
    state = converge({"r": rig(os, gpus=[])}, planned(nvidia_driver.install))
    assert not any("nvidia-driver-580-open" in c for c in executed(state, "r"))


@pytest.mark.parametrize("os,flavor", [(o, f) for o in ("ubuntu2204", "ubuntu2404") for f in ("open", "proprietary")])
def test_ubuntu_archive_source(os, flavor):
    """Ubuntu Server docs, "NVIDIA drivers installation" (https://ubuntu.com/server/docs/nvidia-drivers-installation):
    the prebuilt, signed modules are linux-modules-nvidia-${DRIVER_BRANCH}${SERVER}-${LINUX_FLAVOUR} (+ "-open"
    for the open flavour) beside nvidia-driver-<branch>[-open]; no NVIDIA repository, NVIDIA's pinned out."""
    name = "nvidia-driver-580-open" if flavor == "open" else "nvidia-driver-580"
    modules = "linux-modules-nvidia-580-open-generic" if flavor == "open" else "linux-modules-nvidia-580-generic"
    hosts = {"u": rig(os, gpus=[], nvidia_driver_source="ubuntu", nvidia_driver_flavor=flavor)}
    files = uploads(converge(hosts, planned(nvidia_driver.install), execute=False), "u")
    assert not any("rigforge-nvidia-cuda" in path for path in files)
    pin = files["/etc/apt/preferences.d/rigforge-nvidia-ubuntu-archive"].splitlines()
    assert pin[1:] == [
        f"Package: nvidia-* libnvidia-* {name} {modules}",
        'Pin: origin "developer.download.nvidia.com"',
        "Pin-Priority: -1",
    ]
    commands = executed(converge(hosts, planned(nvidia_driver.install)), "u")
    assert not any("pinning" in c or "developer.download.nvidia.com" in c for c in commands)
    (install,) = [c for c in commands if " install " in c and name in c]
    assert install.split()[-2:] == [name, modules]
    # the prebuilt modules follow the kernel (linux-modules-nvidia-* upgrades with linux-image-generic): not held,
    # not kept out of unattended upgrades; the driver itself is
    installed = [(name, "580.95.05-0ubuntu1"), (modules, "6.8.0-90.91"), ("ca-certificates", "1"), ("curl", "1")]
    done = converge(
        {"u": rig(os, gpus=[], packages=installed, nvidia_driver_source="ubuntu", nvidia_driver_flavor=flavor)},
        planned(nvidia_driver.install),
        execute=False,
    )
    assert op_commands(done, "u", apt_repo.hold, packages=PackageSet("", (name,), (name,))) == [f"apt-mark hold {name}"]
    unattended = files["/etc/apt/apt.conf.d/51rigforge-nvidia-unattended-upgrades"]
    assert f'"^{name}$";' in unattended and "linux-modules" not in unattended


def test_ubuntu_source_and_missing_rows_are_refused_in_preflight():
    data = {"nvidia_driver_source": "ubuntu"}
    debian = {"id": "debian", "version_id": "13"}
    (problem,) = preflight.host_state_problems(RoleKnobs.of(data), debian, "amd64", {}, {})
    assert "no open driver package for debian from nvidia_driver_source='ubuntu'" in problem
    assert "use nvidia_driver_source: cuda" in problem
    for bad, key in (
        (575, "nvidia_driver_branch"),
        ("latest", "nvidia_driver_branch"),
        ("nvidia", "nvidia_driver_source"),
    ):
        _, problems = fleet.plan_for("r", {"rigforge_variant": "dual-turbo", key: bad}, deployable=False)
        assert len(problems) == 1 and problems[0].startswith(f"{key}={bad!r}"), problems


# --- Docker and the NVIDIA Container Toolkit -----------------------------------------------------------


@pytest.mark.parametrize(
    "os,distro,codename",
    [
        ("ubuntu2204", "ubuntu", "jammy"),
        ("ubuntu2404", "ubuntu", "noble"),
        ("debian12", "debian", "bookworm"),
        ("debian13", "debian", "trixie"),
    ],
)
def test_docker_repo_then_conflicting_packages_removed_once_docker_ce_is_fetched(os, distro, codename):
    """Docker, "Install Docker Engine on Ubuntu" / "on Debian" (https://docs.docker.com/engine/install/ubuntu/,
    https://docs.docker.com/engine/install/debian/): "uninstall all conflicting packages: docker.io docker-doc
    docker-compose docker-compose-v2 podman-docker containerd runc"; the key from <repo>/gpg with fingerprint
    9DC8 5822 9FC7 DD38 854A E2D8 8D81 803C 0EBF CD88; a deb822 source with Suites: <codename>, Components:
    stable; then docker-ce docker-ce-cli containerd.io docker-buildx-plugin docker-compose-plugin."""
    installed = [("docker.io", "1"), ("runc", "1"), ("containerd", "1")]
    hosts = {"d": rig(os, packages=installed)}
    files = uploads(converge(hosts, planned(docker_engine.install), execute=False), "d")
    assert files["/etc/apt/sources.list.d/rigforge-docker.sources"].splitlines()[1:] == [
        "Types: deb",
        f"URIs: https://download.docker.com/linux/{distro}",
        f"Suites: {codename}",
        "Components: stable",
        "Architectures: amd64",
        "Signed-By: /etc/apt/keyrings/rigforge-docker.asc",
    ]
    commands = executed(converge(hosts, planned(docker_engine.install)), "d")
    (remove,) = [c for c in commands if " remove " in c]
    assert remove.split()[-3:] == ["docker.io", "containerd", "runc"]
    (key,) = [c for c in commands if f"https://download.docker.com/linux/{distro}/gpg" in c]
    assert "9DC858229FC7DD38854AE2D88D81803C0EBFCD88" in key
    (install,) = [c for c in commands if " install " in c and "docker-ce" in c and "--download-only" not in c]
    assert install.split()[-5:] == [
        "docker-ce",
        "docker-ce-cli",
        "containerd.io",
        "docker-buildx-plugin",
        "docker-compose-plugin",
    ]
    assert commands.index(remove) < commands.index(install)
    # the destructive step last (issue 32): Docker's key and packages are fetched before docker.io goes; if they
    # cannot be, the host fails there with docker.io left as it was
    (fetch,) = [c for c in commands if "--download-only" in c]
    assert "'docker-ce' 'docker-ce-cli' 'containerd.io' 'docker-buildx-plugin' 'docker-compose-plugin'" in fetch
    assert "nothing removed, docker.io, containerd, runc left installed and running" in fetch
    assert commands.index(key) < commands.index(fetch) < commands.index(remove)


def test_toolkit_pins_all_four_packages_together():
    """NVIDIA Container Toolkit install guide
    (https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/install-guide.html): the repo
    https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) / with the key .../gpgkey, and with a version
    "nvidia-container-toolkit=${V} nvidia-container-toolkit-base=${V} libnvidia-container-tools=${V}
    libnvidia-container1=${V}"."""
    hosts = {"t": rig("ubuntu2404", nvidia_toolkit_version="1.18.0-1")}
    files = uploads(converge(hosts, planned(docker_engine.install), execute=False), "t")
    source = files["/etc/apt/sources.list.d/rigforge-nvidia-container-toolkit.sources"].splitlines()
    assert "URIs: https://nvidia.github.io/libnvidia-container/stable/deb/amd64/" in source and "Suites: /" in source
    commands = executed(converge(hosts, planned(docker_engine.install)), "t")
    assert any("https://nvidia.github.io/libnvidia-container/gpgkey" in c for c in commands)
    (install,) = [c for c in commands if " install " in c and "nvidia-container-toolkit" in c]
    assert install.split()[-4:] == [
        "nvidia-container-toolkit=1.18.0-1",
        "nvidia-container-toolkit-base=1.18.0-1",
        "libnvidia-container-tools=1.18.0-1",
        "libnvidia-container1=1.18.0-1",
    ]
    assert toolkit(None).specs == ("nvidia-container-toolkit",) and not toolkit(None).held


def toolkit_commands(packages=(), held=(), **data) -> tuple[list[str], list[str]]:
    """(the toolkit's apt-get install arguments, the apt-mark hold commands) a fake rig gets from docker_engine."""
    hosts = {"t": rig("ubuntu2404", packages=packages, held=held, **data)}
    commands = executed(converge(hosts, planned(docker_engine.install)), "t")
    installs = [c.split() for c in commands if " install " in c and "nvidia-container-toolkit" in c]
    return (installs[0] if installs else []), [c for c in commands if c.startswith("apt-mark hold")]


def test_lock_pins_and_holds_the_toolkit_by_default():
    """NVIDIA/nvidia-container-toolkit#1967: upgrading 1.19.0 to 1.19.1 broke cuInit inside containers
    (downgrading fixed it; one report of the same on 1.20.0). The lock pins all four packages at 1.19.0-1 and the
    rig holds them, without any host data."""
    assert load_lock(default_lock_path()).toolkit.version == "1.19.0-1"
    install, _ = toolkit_commands()
    assert install[-4:] == [f"{name}=1.19.0-1" for name in TOOLKIT_PACKAGES]
    assert "--allow-change-held-packages" in install  # moving the pin replaces what rigforge held itself
    installed = [(name, "1.19.0-1") for name in TOOLKIT_PACKAGES]
    install, holds = toolkit_commands(packages=installed)
    assert install == [] and holds == ["apt-mark hold " + " ".join(sorted(TOOLKIT_PACKAGES))]
    assert toolkit_commands(packages=installed, held=TOOLKIT_PACKAGES) == ([], [])  # a no-op


def test_host_data_overrides_the_locked_toolkit_version():
    install, _ = toolkit_commands(nvidia_toolkit_version="1.19.1-1")
    assert install[-4:] == [f"{name}=1.19.1-1" for name in TOOLKIT_PACKAGES]


def test_testbed_repo_serves_the_locked_toolkit_and_a_newer_one():
    """The testbed's stand-in repo has the lock's version and a newer one, so the pin is what keeps a rig on it."""
    from rigforge.testbed import aptrepo

    assert aptrepo.TOOLKIT_DEB_VERSION == load_lock(default_lock_path()).toolkit.version
    assert aptrepo.NEXT_TOOLKIT_VERSION.split(".") > aptrepo.TOOLKIT_VERSION.split(".")


def test_lock_without_a_toolkit_entry_installs_the_latest_unheld(tmp_path):
    data = yaml.safe_load(default_lock_path().read_text())
    del data["toolkit"]
    (tmp_path / "lock.yaml").write_text(yaml.safe_dump(data))
    install, holds = toolkit_commands(rigforge_lock=str(tmp_path / "lock.yaml"))
    assert install[-1] == "nvidia-container-toolkit" and holds == []


# --- hand-set-up rigs: existing sources, keys, a driver no package owns -------------------------------------

# What the vendors' instructions leave on a rig (Docker: one-line form and the newer deb822 form; the toolkit's
# nvidia-container-toolkit.list after its sed; NVIDIA's cuda-keyring package: cuda-<distro>-<arch>.list).
DOCKER_LIST = (
    "deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] https://download.docker.com/linux/ubuntu noble stable\n"
)
DOCKER_SOURCES = """Types: deb
URIs: https://download.docker.com/linux/ubuntu
Suites: noble
Components: stable
Signed-By: /etc/apt/keyrings/docker.asc
"""
TOOLKIT_LIST = (
    "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
    "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n"
    "#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
    "https://nvidia.github.io/libnvidia-container/experimental/deb/$(ARCH) /\n"
)
CUDA_LIST = (
    "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
    "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/ /\n"
)


def source_listing(files: dict[str, str]) -> list[str]:
    return [line for path, text in files.items() for line in (f"==> rigforge-source-file {path}", *text.splitlines())]


def test_source_files_are_parsed_in_both_forms():
    assert parse_one_line(DOCKER_LIST) == ["https://download.docker.com/linux/ubuntu"]
    assert parse_deb822(DOCKER_SOURCES) == ["https://download.docker.com/linux/ubuntu"]
    assert parse_deb822(DOCKER_SOURCES.replace("Types", "Enabled: no\nTypes")) == []
    assert parse_one_line(TOOLKIT_LIST) == ["https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH)"]
    listing = AptSourceFiles().process(
        source_listing(
            {
                "/etc/apt/sources.list.d/docker.list": DOCKER_LIST,
                "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": CUDA_LIST,
            }
        )
    )
    assert same_uri_files(listing, f"{CUDA}/ubuntu2404/x86_64", "/x") == {
        "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": True
    }


def hand_set_up(extra=None, **data):
    listing = source_listing(
        {
            "/etc/apt/sources.list.d/docker.list": DOCKER_LIST,
            "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": CUDA_LIST,
            "/etc/apt/sources.list.d/rigforge-docker.sources": "URIs: https://download.docker.com/linux/ubuntu\n",
        }
    )
    return rig("ubuntu2404", gpus=[], extra={"rigforge-source-file": listing, **(extra or {})}, **data)


def test_hand_set_up_sources_are_replaced_and_kept_as_backup():
    state = converge({"h": hand_set_up()}, planned(docker_engine.install))
    commands = executed(state, "h")
    assert "mv -f /etc/apt/sources.list.d/docker.list /etc/apt/sources.list.d/docker.list.rigforge-bak" in commands
    assert not any("rigforge-docker.sources.rigforge-bak" in c for c in commands)  # its own file stays
    move = commands.index("mv -f /etc/apt/sources.list.d/docker.list /etc/apt/sources.list.d/docker.list.rigforge-bak")
    assert move < next(i for i, c in enumerate(commands) if "apt-get update" in c and i > move)
    ignore = uploads(converge({"h": hand_set_up()}, planned(docker_engine.install), execute=False), "h")
    assert ignore["/etc/apt/apt.conf.d/50rigforge-ignore-backups"].endswith(
        'Dir::Ignore-Files-Silently:: "\\.rigforge-bak$";\n'
    )


def test_adoption_off_is_refused_in_preflight_naming_each_file():
    sources = AptSourceFiles().process(
        source_listing(
            {
                "/etc/apt/sources.list.d/docker.list": DOCKER_LIST,
                "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": CUDA_LIST,
            }
        )
    )
    ubuntu = {"id": "ubuntu", "version_id": "24.04", "codename": "noble"}
    assert preflight.host_state_problems(RoleKnobs.of({}), ubuntu, "amd64", {}, sources) == []  # adopted by default
    problems = preflight.host_state_problems(RoleKnobs.of({"apt_adopt_sources": False}), ubuntu, "amd64", {}, sources)
    assert [p.split(" already points at")[0] for p in problems] == [
        "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list",
        "/etc/apt/sources.list.d/docker.list",
    ]
    assert all("apt_adopt_sources: true" in p for p in problems)
    mixed = AptSourceFiles().process(
        source_listing({"/etc/apt/sources.list": DOCKER_LIST + "deb http://archive.ubuntu.com/ubuntu noble main\n"})
    )
    (problem,) = preflight.host_state_problems(RoleKnobs.of({}), ubuntu, "amd64", {}, mixed)
    assert problem.startswith("/etc/apt/sources.list points at https://download.docker.com/linux/ubuntu and at other")


PROC = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)"


def test_a_running_driver_no_package_owns_is_refused_unless_left_alone():
    """The issue's 2xH200 host: driver 580.159.04 from the .run installer, no driver package in dpkg."""
    unowned = NvidiaRunningDriver().process(
        [f"proc={PROC}", "module=580.159.04", "smi=/usr/bin/nvidia-smi", "smi_ok=1", "owner="]
    )
    want = {"version": "580.159.04", "smi": "/usr/bin/nvidia-smi", "smi_ok": True, "owner": None, "cuda": None}
    assert unowned == want
    assert preflight.unowned_driver(unowned)
    owned = NvidiaRunningDriver().process(
        [f"proc={PROC}", "smi=/usr/bin/nvidia-smi", "smi_ok=1", "owner=nvidia-utils-580: /usr/bin/nvidia-smi"]
    )
    assert not preflight.unowned_driver(owned)
    ubuntu, defaults = {"id": "ubuntu", "version_id": "24.04", "codename": "noble"}, RoleKnobs.of({})
    assert owned["owner"] == "nvidia-utils-580"
    assert preflight.host_state_problems(defaults, ubuntu, "amd64", owned, {}) == []
    (problem,) = preflight.host_state_problems(defaults, ubuntu, "amd64", unowned, {})
    assert problem.startswith("NVIDIA driver 580.159.04 is running but no package owns /usr/bin/nvidia-smi")
    assert "nvidia_driver_manage: false" in problem and "\n" not in problem
    left_alone = RoleKnobs.of({"nvidia_driver_manage": False})
    assert preflight.host_state_problems(left_alone, ubuntu, "amd64", unowned, {}) == []
    (other,) = preflight.host_state_problems(
        RoleKnobs.of({"nvidia_driver_manage": False, "nvidia_driver_branch": 590}), ubuntu, "amd64", unowned, {}
    )
    assert "running NVIDIA driver is 580.159.04, not branch 590" in other


def test_driver_left_alone_only_checks_the_branch():
    state = converge(
        {"m": rig(gpus=[], nvidia_driver_manage=False, extra={"proc=": [f"proc={PROC}", "smi_ok=1"]})},
        planned(nvidia_driver.install),
    )
    assert not state.failed_hosts
    assert not any("apt" in c or "curl" in c for c in executed(state, "m"))


def test_fingerprints_from_gpg_colons():
    colons = [
        "pub:-:4096:1:A4B469963BF863CC:1650567432:::-:::scSC::::::23::0:",
        "fpr:::::::::EB693B3035CD5710E231E123A4B469963BF863CC:",
        "uid:-::::1650567432::5F7D2D1EE2E8C7B1::cudatools <cudatools@nvidia.com>::::::::::0:",
        "sub:-:4096:1:1111111111111111:1650567432::::::e::::::23:",
        "fpr:::::::::0000000000000000000000001111111111111111:",
    ]
    assert KeyFingerprints().process(colons) == ["EB693B3035CD5710E231E123A4B469963BF863CC"]


def test_a_key_already_in_place_with_the_right_fingerprint_is_a_no_op():
    fpr = ["pub:-:4096:1:x:1:::-:::scSC:", f"fpr:::::::::{NEW_KEY[1]}:"]
    state = converge({"k": rig("debian13", extra={"--show-keys": fpr})}, planned(nvidia_driver.install), execute=False)
    dest = "/etc/apt/keyrings/rigforge-nvidia-cuda.asc"
    assert op_commands(state, "k", apt_repo.verified_key, src="x", dest=dest, fingerprint=NEW_KEY[1]) == []
    (replace,) = op_commands(state, "k", apt_repo.verified_key, src="x", dest=dest, fingerprint=OLD_KEY[1])
    assert "refused x: key fingerprint" in replace and "exit 1" in replace


# --- validation: every problem names the key, the bad value and what is allowed ----------------------------


def test_validate_names_key_value_and_allowed_values():
    good = {**rigforge.model.knobs.nvidia_driver.DEFAULTS}
    assert rigforge.model.knobs.nvidia_driver.validate(good) == []
    bad = {
        **good,
        "nvidia_driver_source": "ppa",
        "nvidia_driver_flavor": "closed",
        "nvidia_driver_branch": 575,
        "nvidia_driver_manage": "yes",
        "apt_adopt_sources": 1.5,
        "nvidia_driver_repo_key_fingerprint": "3bf863cc",
    }
    assert rigforge.model.knobs.nvidia_driver.validate(bad) == [
        "nvidia_driver_source='ppa' is not one of: cuda, ubuntu.",
        "nvidia_driver_flavor='closed' is not one of: open, proprietary.",
        "nvidia_driver_branch=575 must be a branch number, 580 or later (e.g. 580, 590).",
        "nvidia_driver_manage='yes' must be true or false.",
        "apt_adopt_sources=1.5 must be true or false.",
        "nvidia_driver_repo_key_fingerprint='3bf863cc' must be a 40-hex-digit key fingerprint.",
    ]
    docker = {**rigforge.model.knobs.docker_engine.DEFAULTS}
    assert rigforge.model.knobs.docker_engine.validate(docker) == []
    assert rigforge.model.knobs.docker_engine.validate(
        {**docker, "docker_source": "snap", "nvidia_toolkit_version": 1.18}
    ) == [
        "docker_source='snap' is not one of: docker, distro.",
        "nvidia_toolkit_version=1.18 must be a package version such as 1.18.0-1, or unset.",
    ]


def test_no_such_package_stops_the_host_in_preflight_not_the_run():
    """nvidia_driver_source: ubuntu on Debian: that host fails in preflight with the reason; the other converges."""
    from dataclasses import replace

    from pyinfra.api import deploy
    from test_roles_host_ops import PREFLIGHT

    from rigforge.model import fleet

    @deploy("site")
    def _site():
        from pyinfra import host

        preflight.check(replace(PREFLIGHT, disk_bytes=1), *checked(fleet.host_data(host.data)))
        planned(nvidia_driver.install)()

    state = converge({"d": rig("debian13", gpus=[], nvidia_driver_source="ubuntu"), "ok": rig(gpus=[])}, _site)
    assert {h.name for h in state.failed_hosts} == {"@fake/d"}
    assert not any("apt-get" in c for c in executed(state, "d"))
    assert any("nvidia-driver-pinning-580" in c for c in executed(state, "ok"))
