"""Tier 2 (issue 47): one verdict per resource (rigforge/observe/verdict.py), on observed facts as the rig gives them.

The deploy's operations and status/verify call these same functions, so each case here is what both say. The
facts are the shapes the fact classes return (their parsers are tested on real output elsewhere).
"""

from test_cuda import DATA, preflight

from rigforge.model import packages
from rigforge.model.packages import PackageSet
from rigforge.model.pins import GitPin, HfFile, HfPin
from rigforge.observe import verdict

SHA = "a" * 40
PIN = GitPin("genesis", "git://127.0.0.1/genesis.git", "main", SHA, sparse=("vllm/",))
CLEAN = {"head": SHA, "url": PIN.url, "sparse": True, "patterns": ["/vllm/"], "dirty": [], "files": {}}


def test_a_checkout_as_declared_has_no_problem_and_each_difference_is_named():
    assert verdict.checkout(PIN, "/opt/rigforge/src/genesis", CLEAN) == []
    assert verdict.checkout(PIN, "/src/g", None) == ["git genesis: no checkout at /src/g"]
    moved = verdict.checkout(PIN, "/src/g", {**CLEAN, "head": "b" * 40})
    assert moved == [f"git genesis: HEAD {'b' * 12}, lock {'a' * 12}"]
    url = verdict.checkout(PIN, "/src/g", {**CLEAN, "url": "https://example.invalid/g.git"})
    assert url == ["git genesis: origin is https://example.invalid/g.git, lock git://127.0.0.1/genesis.git"]
    sparse = verdict.checkout(PIN, "/src/g", {**CLEAN, "sparse": False, "patterns": []})
    assert sparse == ["git genesis: sparse checkout off, lock /vllm/"]
    dirty = verdict.checkout(PIN, "/src/g", {**CLEAN, "dirty": [" M vllm/x.py", "?? y"]})
    assert dirty == ["git genesis: dirty checkout at /src/g (2 file(s), e.g. M vllm/x.py)"]
    provisioned = verdict.checkout(PIN, "/src/g", CLEAN, "c" * 40, "provisioned")
    assert provisioned == [f"git genesis: HEAD {'a' * 12}, provisioned {'c' * 12}"]


WEIGHTS = HfPin(
    "int4", "org/int4", "r" * 40, files=(HfFile("a.safetensors", 10, "1" * 64), HfFile("b.json", 2, "2" * 64))
)
STAMP = {
    "revision": "r" * 40,
    "files": {
        "a.safetensors": {"size": 10, "sha256": "1" * 64, "mtime_ns": 5},
        "b.json": {"size": 2, "sha256": "2" * 64, "mtime_ns": 6},
    },
}


def test_weights_are_as_declared_only_when_every_file_is_as_stamped():
    state = {"stamp": STAMP, "files": {"a.safetensors": [10, 5], "b.json": [2, 6]}, "staging_dir": False}
    assert verdict.stale_weights(WEIGHTS, state) == {} and verdict.weights(WEIGHTS, "/m/int4", state) == []
    rewritten = {**state, "files": {"a.safetensors": [10, 7], "b.json": [2, 6]}}
    assert verdict.stale_weights(WEIGHTS, rewritten) == {
        "a.safetensors": "modified since it was verified (mtime differs from the stamp)"
    }
    gone = {**state, "files": {"b.json": [2, 6]}}
    assert verdict.weights(WEIGHTS, "/m/int4", gone) == ["hf int4: a.safetensors missing"]
    fresh = {"stamp": None, "files": {}, "staging_dir": True}
    assert verdict.weights(WEIGHTS, "/m/int4", fresh) == [
        "hf int4: no stamp in /m/int4 (2 file(s) not verified)",
        "hf int4: a staging dir left by an interrupted download",
    ]
    bumped = {**state, "stamp": {**STAMP, "revision": "s" * 40}}
    assert set(verdict.stale_weights(WEIGHTS, bumped)) == {"a.safetensors", "b.json"}


def test_the_distro_docker_set_on_debian_13_includes_the_cli_and_its_files():
    distro = packages.docker("distro", "debian", "13")
    installed = {"docker.io": ["26.1.5+dfsg1-9"], "docker-compose": ["2.26.1-4"]}  # --no-install-recommends
    assert verdict.missing_packages(distro, installed) == ["docker-cli"]
    assert verdict.packages(distro, installed, [], {}) == ["docker-cli is not installed"]
    installed["docker-cli"] = ["26.1.5+dfsg1-9"]
    assert verdict.packages(distro, installed, [], {}) == []
    lost = {"/usr/bin/docker": "docker-cli"}  # ProvidedFiles: the file is gone, dpkg still knows its owner
    assert verdict.to_reinstall(distro, installed, lost) == {"docker-cli": "/usr/bin/docker"}
    assert verdict.packages(distro, installed, [], lost) == [
        "/usr/bin/docker is missing, its package installed (docker-cli): the deploy reinstalls it"
    ]


def test_a_file_whose_owner_is_a_dependency_reinstalls_that_package_and_an_unowned_one_the_set():
    driver = PackageSet("driver", ("nvidia-open",), provides=(packages.NVIDIA_SMI,))
    installed = {"nvidia-open": ["580.1-1"], "nvidia-smi": ["580.1-1"]}
    assert verdict.to_reinstall(driver, installed, {packages.NVIDIA_SMI: "nvidia-smi"}) == {
        "nvidia-smi": packages.NVIDIA_SMI
    }
    assert verdict.to_reinstall(driver, installed, {packages.NVIDIA_SMI: None}) == {"nvidia-open": packages.NVIDIA_SMI}
    assert verdict.to_reinstall(driver, {}, {packages.NVIDIA_SMI: None}) == {}  # the install brings it


def test_held_packages_include_the_drivers_libraries_at_its_version():
    driver = PackageSet(
        "driver", ("nvidia-open",), ("nvidia-open",), held_with="nvidia-open", held_prefixes=("libnvidia-",)
    )
    installed = {"nvidia-open": ["580.95.05-1"], "libnvidia-ml1": ["580.95.05-1"], "libnvidia-old": ["525.1-1"]}
    assert verdict.unheld_packages(driver, installed, []) == ["libnvidia-ml1", "nvidia-open"]
    assert verdict.packages(driver, installed, ["nvidia-open"], {}) == ["libnvidia-ml1 is not held (apt-mark hold)"]
    assert verdict.unheld_packages(driver, installed, ["libnvidia-ml1", "nvidia-open"]) == []


def test_a_pinned_version_elsewhere_is_named_with_both_versions():
    toolkit = packages.toolkit("1.19.0-1")
    installed = {name: ["1.19.0-1"] for name in packages.TOOLKIT_PACKAGES} | {"libnvidia-container1": ["1.18.0-1"]}
    assert verdict.packages(toolkit, installed, packages.TOOLKIT_PACKAGES, {}) == [
        "libnvidia-container1 is at 1.18.0-1, lock 1.19.0-1"
    ]


def test_a_rendered_file_is_compared_by_content_and_mode():
    text = "KEY=1\n"
    digest = verdict.sha256_text(text)
    assert verdict.rendered_file("/s/.env", text, "600", {"mode": 600}, digest) == []
    assert verdict.rendered_file("/s/.env", text, "600", None, None) == ["/s/.env is missing"]
    assert verdict.rendered_file("/s/.env", text, "600", {"mode": 644}, digest) == [
        "/s/.env has mode 644, rigforge's is 600"
    ]
    edited = verdict.rendered_file("/s/.env", text, "600", {"mode": 600}, "0" * 64)
    assert edited == ["/s/.env differs from what rigforge renders (edited on the rig? the deploy rewrites it)"]


def test_caps_and_persistence_are_decided_in_whole_watts_and_on_off():
    gpus = [{"index": 0, "power_limit": 230.0, "persistence_mode": True}, {"index": 1, "power_limit": 250.0}]
    assert verdict.caps(gpus, {0: 230, 1: 230}) == ["GPU1 at 250 W, declared 230 W"]
    assert verdict.caps(gpus[:1], {0: 230}) == [] and verdict.persistence(gpus) == []  # None: not reported
    assert verdict.persistence([{"index": 0, "persistence_mode": False}]) == ["persistence mode off on GPU 0"]


def test_daemon_json_keys_are_the_declared_ones_and_the_users_keys_stay_theirs():
    patch = {"runtimes": {"nvidia": {"path": "nvidia-container-runtime", "args": []}}}
    path = "/etc/docker/daemon.json"
    assert verdict.json_keys(path, {"log-level": "warn", **patch}, patch) == []
    assert verdict.json_keys(path, {"log-level": "warn"}, patch) == [f"{path}: runtimes is not as declared"]
    assert verdict.json_keys(path, None, patch) == [f"{path} is missing or not a JSON object"]


def test_an_os_whose_archive_has_no_compose_v2_is_refused_for_the_distro_source():
    debian12 = {"id": "debian", "version_id": "12"}
    problems = preflight({**DATA, "docker_source": "distro"}, "13.0", os_release=debian12)
    assert problems == [
        "docker_source='distro' leaves no `docker compose`: Debian 12's archive has no compose v2 package; "
        "set docker_source: docker."
    ]
    assert preflight({**DATA, "docker_source": "distro"}, "13.0") == []
