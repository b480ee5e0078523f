"""Shared pytest fixtures: the testbed (simulated rigs over real SSH, see rigforge/testbed).

- `testbed_dir`: the shared testbed directory (env RIGFORGE_TESTBED_DIR, default /var/lib/rigforge-testbed);
  it holds the cached rootfs tarball and runs the local apt / git / HF stand-ins.
- `testbed_factory`: `make(specs, name=...)` -> Testbed of fresh rigs in their own fleet directory (own ports,
  own inventory), sharing the cache and services. Everything made is torn down at the end of the session,
  and the services too unless they were running before the session or other rigs in the dir still use them.
- `testbed`: one 2-rig testbed (2x simulated RTX 3090 each) for tests that only need to read.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTBED_TIMES: list[str] = []  # shown in the terminal summary (set-up times of the testbed)
# seconds of set-up, call and tear-down, summed per unit of work (`_module`) and per worker: shown in the terminal
# summary, where the suite's time goes (CI's budget is 50 minutes)
UNIT_SECONDS: dict[tuple[str, str], float] = {}


# Debian packages the fast loop runs for real (a gateway config through haproxy, alert rules through promtool, the
# fleet page through prometheus and headless chromium): {command: package}
FAST_LOOP_TOOLS = {"haproxy": "haproxy", "promtool": "prometheus", "prometheus": "prometheus", "chromium": "chromium"}


def missing_fast_loop_packages() -> list[str]:
    """The Debian packages of FAST_LOOP_TOOLS whose command is not on this machine."""
    return sorted({package for command, package in FAST_LOOP_TOOLS.items() if not shutil.which(command)})


def install_line(packages: list[str]) -> str:
    """What to run to get `packages`, and why."""
    return (
        f"missing Debian packages the tests run for real: {', '.join(packages)}; their tests fail until you run "
        f"`sudo apt-get install --no-install-recommends {' '.join(packages)}` (.ci/run installs them)"
    )


def pytest_report_header(config) -> list[str]:
    """Said first: which of the fast loop's Debian packages are missing, and how to install them."""
    missing = missing_fast_loop_packages()
    return [install_line(missing)] if missing else []


def pytest_terminal_summary(terminalreporter):
    missing = missing_fast_loop_packages()
    if missing:  # said again last, beside the failures it explains
        terminalreporter.section("missing packages")
        terminalreporter.write_line(install_line(missing))
    if TESTBED_TIMES:
        terminalreporter.section("testbed set-up times")
        for line in TESTBED_TIMES:
            terminalreporter.write_line(line)
    if UNIT_SECONDS:
        terminalreporter.section("seconds per module (the heaviest), and per worker")
        by_worker: dict[str, float] = {}
        for (worker, _), seconds in UNIT_SECONDS.items():
            by_worker[worker] = by_worker.get(worker, 0.0) + seconds
        heaviest = sorted(UNIT_SECONDS.items(), key=lambda item: -item[1])[:30]
        for (worker, module), seconds in heaviest:
            terminalreporter.write_line(f"{seconds:7.0f}s  {worker}  {module}")
        terminalreporter.write_line(
            "  ".join(f"{worker}: {seconds:.0f}s" for worker, seconds in sorted(by_worker.items()))
        )


def pytest_runtest_logreport(report) -> None:
    """Adds a test phase's duration to its unit of work's (on the controller under xdist: the worker's report)."""
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    key = (worker, _module(report.nodeid))
    UNIT_SECONDS[key] = UNIT_SECONDS.get(key, 0.0) + report.duration


@pytest.fixture(scope="session")
def testbed_report() -> list[str]:
    """Append a line to show it in the terminal summary."""
    return TESTBED_TIMES


def _testbed_problem() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root (chroot, sshd, useradd)"
    for tool in ("debootstrap", "chroot", "ssh-keygen", "dpkg-deb", "apt-ftparchive", "gpg", "git", "/usr/sbin/sshd"):
        if not shutil.which(tool):
            return f"{tool} not found (apt-get install debootstrap openssh-server apt-utils gnupg git)"
    return None


@pytest.fixture(scope="session")
def testbed_dir() -> Path:
    """The testbed dir; under pytest-xdist, each worker's own one inside it (fleets/worker-gwN: its own apt / git /
    HF stand-ins, so one worker's throttled or cut downloads and request logs are never another's), sharing the
    cached root file systems and content of the dir (cache/, whose builds are locked)."""
    problem = _testbed_problem()
    if problem:
        pytest.skip(f"testbed unavailable: {problem}")
    from rigforge.testbed import DEFAULT_DIR
    from rigforge.testbed._util import ensure_safe_dir

    base = Path(os.environ.get("RIGFORGE_TESTBED_DIR", DEFAULT_DIR))
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return base
    mine = ensure_safe_dir(base / "fleets" / f"worker-{worker}")
    cache = ensure_safe_dir(base / "cache")
    if not (mine / "cache").is_symlink():
        (mine / "cache").symlink_to(cache)
    return mine


# Heaviest first, so that on three workers (pytest-xdist: -n 3) the long modules start at once and the short ones fill
# in behind them; a module not named here comes after these, in collection order.
HEAVY_FIRST = (
    "testbed/test_booted_fleet.py",
    "testbed/test_booted_rollout.py",
    "testbed/test_booted_serving.py",  # with test_booted_serving_docker: one unit of work (SHARED below)
    "testbed/test_booted_llamacpp.py",
    "testbed/test_booted_cards.py",
    "testbed/test_booted_boot_order.py",
    "testbed/test_booted.py",
    "test_converge_agreement.py",  # with the other modules that start from the converged image (SHARED below)
    "test_converge_recover.py",
    "test_converge_checks.py",
    "test_converge_recipes.py",
    "testbed/test_booted_recipe.py",
    "test_converge_site.py",
    "test_converge_visible.py",
    "test_converge_host.py",
)
SHARED = {  # modules that share a session fixture: one unit of work, in this order
    "testbed/test_booted_serving_docker.py": "testbed/test_booted_serving.py",  # serving_fleet
    "testbed/test_booted_cable.py": "testbed/test_booted_fleet.py",  # booted_fleet
    # converged_image: made once, on the worker that runs these (it is made per worker: its stand-ins' endpoints)
    "test_converge_repair.py": "test_converge_agreement.py",
    "test_status_verify.py": "test_converge_agreement.py",
    "test_cycles_rig.py": "test_converge_agreement.py",
}


def _module(nodeid: str) -> str:
    """The unit of work a test belongs to: its module (tests/-relative), or the module it shares a fixture with."""
    module = nodeid.split("::", 1)[0].removeprefix("tests/")
    return SHARED.get(module, module)


def pytest_collection_modifyitems(config, items):
    """Modules heaviest first, a module that shares a fixture right after the one it shares it with (a stable
    sort: each module's own order holds)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

    def order(item: pytest.Item) -> tuple[int, bool]:
        unit = _module(item.nodeid)
        return rank.get(unit, len(rank)), item.nodeid.split("::", 1)[0].removeprefix("tests/") != unit

    items.sort(key=order)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist runs one unit of work (`_module`) on one worker, in collection order: a module's fixtures are
    set up once, and test_booted_serving_docker takes the rig test_booted_serving left."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module(nodeid)

    return ByModule(config, log)


@pytest.fixture(scope="session")
def testbed_factory(testbed_dir: Path):
    from rigforge.testbed import RigSpec, core, down, up
    from rigforge.testbed._util import pid_alive

    services_were_running = pid_alive(testbed_dir / "run" / "hf.pid") is not None
    made: list[Path] = []
    for pidfile in (testbed_dir / "fleets").glob("pytest-*/pytest.pid"):  # left by sessions that died
        stale = pidfile.parent
        if not Path(f"/proc/{pidfile.read_text().strip()}").exists():
            down(stale)
            shutil.rmtree(stale, ignore_errors=True)

    def make(
        specs: list | None = None,
        name: str = "t",
        fresh: bool = True,
        booted=False,
        gateway=False,
        registry=False,
        monitor=False,
        docker_source="distro",  # what the tests were written for; test_testbed_quickstart takes the default
        image=None,  # a converged rig's image (the converged_image fixture): each rig starts as a copy of it
    ):
        # unique per session and call: concurrent pytest sessions may share the testbed dir
        fleet = testbed_dir / "fleets" / f"pytest-{os.getpid()}-{name}"
        n = 1
        while fleet in made:
            n += 1
            fleet = testbed_dir / "fleets" / f"pytest-{os.getpid()}-{name}-{n}"
        made.append(fleet)
        fleet.mkdir(parents=True, exist_ok=True, mode=0o755)
        (fleet / "pytest.pid").write_text(str(os.getpid()))
        t0 = time.monotonic()
        tb = up(
            fleet,
            specs or [RigSpec()],
            fresh=fresh,
            shared=testbed_dir,
            booted=booted,
            gateway=gateway,
            fleet_registry=registry,
            monitor=monitor,
            docker_source=docker_source,
            image=image,
        )
        TESTBED_TIMES.append(f"{name}: {len(tb.rigs)} rig(s) up in {time.monotonic() - t0:.1f}s")
        return tb

    def release(tb) -> None:
        """Take a module's fleet down when the module ends, not with the session: its booted rigs (systemd, Docker,
        timers, a gateway's Prometheus) stop loading the machine the later modules run on."""
        fleet = Path(tb.dir)
        if fleet in made:
            made.remove(fleet)
            down(fleet)
            shutil.rmtree(fleet, ignore_errors=True)

    make.release = release
    yield make
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(down, made))
    for fleet in made:
        shutil.rmtree(fleet, ignore_errors=True)
    others = [*(testbed_dir / "fleets").glob("*/rigs/*"), *(testbed_dir / "rigs").glob("*")]
    if not services_were_running and not others:  # leave them to testbeds still in use
        core.stop_services(testbed_dir)


@pytest.fixture(scope="session")
def converged_image(testbed_factory, testbed_dir: Path):
    """One default chroot rig converged with deploy/dual_turbo.py (twice: the second run changed nothing), packed in
    this worker's testbed dir and kept there under a key of what the converge depends on (rigforge/testbed/
    converged.py). The modules that test what follows a converge bring their rigs up from it:
    `testbed_factory(specs, name=..., image=converged_image)`; the converge-from-fresh tests start fresh."""
    from rigforge.testbed.converged import converged_image as image

    t0 = time.monotonic()
    made = image(testbed_dir)
    TESTBED_TIMES.append(f"converged image {made.tarball.name}: ready in {time.monotonic() - t0:.1f}s")
    return made


def _can_boot() -> None:
    """Skips the test when rigs cannot boot here."""
    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")


@pytest.fixture(scope="session")
def booted_fleet(testbed_factory):
    """3 booted rigs and the gateway host `gw` (HAProxy, the fleet registry, the monitor), shared by
    test_booted_fleet and then test_booted_cable, which takes the fleet as the other left it and takes it down."""
    from rigforge.testbed import RigSpec

    _can_boot()
    return testbed_factory([RigSpec()] * 3, name="fleet", booted=True, gateway=True, registry=True, monitor=True)


@pytest.fixture(scope="session")
def serving_fleet(testbed_factory):
    """One booted rig behind the gateway, shared by the booted modules that serve one rig (test_booted_serving,
    then test_booted_serving_docker, which takes the rig as serving left it); skipped when rigs cannot boot."""
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    return testbed_factory([RigSpec()], name="serving", booted=True, gateway=True)


@pytest.fixture(scope="session")
def testbed(testbed_factory):
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(), RigSpec()], name="main")
