"""Roots and data that are not rigforge's (issue 47): package managers' and container runtimes' state directories are
refused as rigforge_root or serving_model_dir; a Docker data-root inside or holding a rigforge dir is refused; every
refusal's example is one the same checks accept; a data-root left behind by a move is reported with its size, never
deleted. Pure: no host.
"""

from __future__ import annotations

import re

import pytest

from rigforge.layout import HostLayout
from rigforge.model import fleet, schema
from rigforge.model.hardware import data_root_left, roots_inside
from rigforge.model.knobs import docker_engine

STATE_DIRS = [  # the issue's list: package managers' and container runtimes' state
    "/var/lib/dpkg",
    "/var/lib/apt",
    "/var/cache/apt",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/snapd",
]


def knob_problems(data: dict) -> list[str]:
    """Every role's knob checks over `data`, defaults applied, as the deploy's plan runs them
    (rigforge/model/fleet.py)."""
    full = fleet.host_data(data)
    return [problem for module in (fleet.site, *fleet.KNOBS) for problem in module.validate(full)]


def example_in(message: str) -> str:
    (example,) = re.findall(r"\(e\.g\. ([^) ,]+)", message)
    return example


@pytest.mark.parametrize("tree", STATE_DIRS)
@pytest.mark.parametrize("key", ["rigforge_root", "serving_model_dir"])
def test_package_managers_and_container_runtimes_state_dirs_are_refused(key, tree):
    for path in (tree, f"{tree}/rigforge", f"{tree}/"):
        problems = knob_problems({key: path})
        (problem,) = [p for p in problems if p.startswith(f"{key} must be")]
        assert f"a directory of its own outside {tree}, " in problem, problem
        assert example_in(problem) == "/opt/rigforge"
        assert schema.SETTINGS["root"](example_in(problem)) == "/opt/rigforge"  # the example is accepted


def test_the_issues_root_names_what_owns_the_tree():
    with pytest.raises(ValueError) as refused:
        schema.SETTINGS["root"]("/var/lib/dpkg")
    assert (
        str(refused.value)
        == "a directory of its own outside /var/lib/dpkg, dpkg's package database (e.g. /opt/rigforge)"
    )
    assert schema.SETTINGS["root"]("/var/lib/rigforge") == "/var/lib/rigforge"  # a dir of its own beside them is fine
    assert schema.SETTINGS["root"]("/var/lib/dpkg-rigforge") == "/var/lib/dpkg-rigforge"  # not below dpkg's


@pytest.mark.parametrize(
    "path", sorted(schema.SYSTEM_DIRS | set(schema.MANAGED_TREES) | {f"{t}/x" for t in schema.MANAGED_TREES})
)
def test_every_refused_root_offers_an_example_the_check_accepts(path):
    with pytest.raises(ValueError) as refused:
        schema.SETTINGS["root"](path)
    assert schema.SETTINGS["root"](example_in(str(refused.value)))


@pytest.mark.parametrize(
    "data_root, root, expect",
    [
        (
            "/opt",
            "/opt/rigforge",
            "rigforge_root /opt/rigforge is inside /opt, Docker's data-root set in "
            "/etc/docker/daemon.json; choose a directory of its own outside it (e.g. /srv/rigforge)",
        ),
        (
            "/srv",
            "/srv/rigforge",
            "rigforge_root /srv/rigforge is inside /srv, Docker's data-root set in "
            "/etc/docker/daemon.json; choose a directory of its own outside it (e.g. /opt/rigforge)",
        ),
        (
            "/opt/rigforge/docker",
            "/opt/rigforge",
            "rigforge_root /opt/rigforge holds /opt/rigforge/docker, Docker's data-root set in "
            "/etc/docker/daemon.json; Docker's data-root and rigforge's dir never share a tree: choose a "
            "rigforge_root that does not hold it (e.g. /srv/rigforge)",
        ),
        ("/opt/rigforge", "/opt/rigforge", "rigforge_root /opt/rigforge is inside /opt/rigforge"),
    ],
)
def test_a_rigs_data_root_inside_or_holding_the_root_is_refused_with_an_example_outside_it(data_root, root, expect):
    (problem,) = roots_inside(HostLayout(root=root), data_root)
    assert problem.startswith(expect), problem
    example = example_in(problem)
    assert roots_inside(HostLayout(root=example), data_root) == []  # the example is not refused in turn
    assert schema.SETTINGS["root"](example) == example


def test_a_data_root_inside_the_model_dir_is_refused_once():
    layout = HostLayout(root="/srv/rf", model_dir="/data/models")
    (problem,) = roots_inside(layout, "/data/models/docker")
    assert problem.startswith("serving_model_dir /data/models holds /data/models/docker, Docker's data-root")
    assert roots_inside(HostLayout(root="/srv/rf"), "/srv/rf/models/docker")[0].startswith(
        "rigforge_root /srv/rf holds"
    )
    assert len(roots_inside(HostLayout(root="/srv/rf"), "/srv/rf/models/docker")) == 1  # the model dir: with the root
    assert roots_inside(HostLayout(root="/srv/rf"), "/srv/rf-docker") == []  # a sibling is not inside


@pytest.mark.parametrize(
    "data, expect",
    [
        (
            {"docker_daemon_options": {"data-root": "/opt/rigforge/docker"}},
            "docker_daemon_options data-root='/opt/rigforge/docker' is inside rigforge_root /opt/rigforge: "
            "Docker's data-root and rigforge's dirs never share a tree; choose a data-root apart from it "
            "(e.g. /var/lib/docker).",
        ),
        (
            {"docker_daemon_options": {"data-root": "/srv/docker"}, "rigforge_root": "/srv/docker/rf"},
            "docker_daemon_options data-root='/srv/docker' holds rigforge_root /srv/docker/rf:",
        ),
        (
            {"docker_daemon_options": {"data-root": "/data"}, "serving_model_dir": "/data/models"},
            "docker_daemon_options data-root='/data' holds serving_model_dir /data/models:",
        ),
        (
            {"docker_daemon_options": {"data-root": "/opt"}},
            "docker_daemon_options data-root='/opt' must be a directory of its own, not the system directory /opt "
            "(e.g. /var/lib/docker).",
        ),
        (
            {"docker_daemon_options": {"data-root": "/var/lib/containerd"}},
            "docker_daemon_options data-root='/var/lib/containerd' must be a directory of its own outside "
            "/var/lib/containerd, containerd's images and containers (e.g. /var/lib/docker, Docker's default).",
        ),
        ({"docker_daemon_options": {"data-root": "/var/lib/dpkg/docker"}}, "outside /var/lib/dpkg, dpkg's package"),
        (
            {"docker_daemon_options": {"data-root": "/var/lib/docker/new"}},
            "must be /var/lib/docker itself or a directory outside it, not below /var/lib/docker",
        ),
        ({"docker_daemon_options": {"data-root": "/srv/my docker"}}, "must be an absolute path of letters, digits"),
        ({"docker_daemon_options": {"data-root": 5}}, "must be an absolute path of letters, digits"),
        (
            {"docker_daemon_options": ["data-root", "/srv/docker"]},
            "docker_daemon_options=['data-root', '/srv/docker'] must be a mapping of daemon.json keys",
        ),
    ],
)
def test_a_data_root_the_knob_sets_is_refused_inside_or_holding_rigforges_dirs(data, expect):
    problems = knob_problems(data)
    assert [p for p in problems if p.startswith("docker_daemon_options")] == [
        next(p for p in problems if expect in p)
    ], problems
    if "(e.g. " in expect:  # the example is accepted in turn
        options = {**data["docker_daemon_options"], "data-root": example_in(expect)}
        assert docker_engine.data_root_problems(fleet.host_data({**data, "docker_daemon_options": options})) == []


def test_data_roots_apart_from_rigforges_dirs_are_accepted():
    for data in (
        {"docker_daemon_options": {"data-root": "/srv/docker"}},
        {"docker_daemon_options": {"data-root": "/var/lib/docker/"}},
        {"docker_daemon_options": {"data-root": "/opt/rigforge-docker", "log-level": "warn"}},
        {"docker_daemon_options": {"log-level": "warn"}},
        {"docker_daemon_options": {"data-root": "/srv/docker"}, "serving_model_dir": "/data/models"},
        {"rigforge_root": "/var/lib/dpkg", "docker_daemon_options": {"data-root": "/srv/docker"}},  # root: own check
    ):
        assert docker_engine.data_root_problems(fleet.host_data(data)) == [], data


def test_the_plan_refuses_a_data_root_in_the_root_with_the_other_knobs():
    _, problems = fleet.plan_for("r", {"docker_daemon_options": {"data-root": "/opt/rigforge/d"}}, "dual-turbo")
    assert any(
        p.startswith("docker_daemon_options data-root='/opt/rigforge/d' is inside rigforge_root") for p in problems
    )


def sizes(table: dict[str, int]):
    return lambda path: table.get(path)


def test_a_moved_data_root_is_named_with_its_size_and_never_deleted():
    left = data_root_left("/var/lib/docker", "/srv/docker", sizes({"/var/lib/docker": 103_000_000}))
    assert left == (
        "this run sets Docker's data-root to /srv/docker in /etc/docker/daemon.json; /var/lib/docker, the one it uses "
        "now, holds 0.1 GB; rigforge neither copies nor deletes it; once the rig serves from /srv/docker, remove it "
        "with: sudo rm -rf /var/lib/docker"
    )
    left = data_root_left("/srv/docker", "/data/docker", sizes({"/srv/docker": 52_600_000_000}))
    assert left.startswith("this run sets Docker's data-root to /data/docker") and "/srv/docker, the one" in left
    assert "holds 52.6 GB" in left and left.endswith("remove it with: sudo rm -rf /srv/docker")


def test_an_earlier_default_data_root_is_named_on_every_later_run():
    left = data_root_left("/srv/docker", "/srv/docker", sizes({"/var/lib/docker": 5_200_000}))
    assert left == (
        "/etc/docker/daemon.json sets Docker's data-root to /srv/docker; /var/lib/docker, an earlier one that Docker "
        "no longer uses, holds 5.2 MB; rigforge neither copies nor deletes it; once the rig serves from /srv/docker, "
        "remove it with: sudo rm -rf /var/lib/docker"
    )


def test_nothing_is_said_without_a_data_root_left_behind():
    everything = sizes({"/var/lib/docker": 1, "/srv/docker": 1})
    assert data_root_left("/var/lib/docker", "/var/lib/docker", everything) is None  # the default, in use
    assert data_root_left("/var/lib/docker", "/srv/docker", sizes({})) is None  # the old one does not exist
    assert data_root_left("/srv/docker", "/srv/docker", sizes({"/srv/docker": 1})) is None  # no default left


def test_a_data_root_moved_inside_the_old_one_is_not_offered_for_rm():
    left = data_root_left("/data", "/data/docker", sizes({"/data": 2_000_000_000}))
    assert "rm -rf" not in left and left.endswith("/data/docker is inside it: remove the rest of it by hand")


def test_the_deploy_reads_the_data_root_after_this_run_from_the_knob_else_the_rig():
    from rigforge.model.knobs.docker_engine import DockerEngine
    from roles.preflight import data_root_after

    rig, unset = ['{"data-root": "/srv/docker"}'], DockerEngine.of({"docker_daemon_options": {}})
    moved = DockerEngine.of({"docker_daemon_options": {"data-root": "/data/docker/"}})
    assert data_root_after(unset, rig) == "/srv/docker"
    assert data_root_after(unset, None) == "/var/lib/docker"
    assert data_root_after(moved, rig) == "/data/docker"


def test_status_shows_the_data_root_left_as_a_note():
    from rigforge.cli.status import notes

    row = {"host": "rig1", "data_root_left": "/etc/docker/daemon.json sets Docker's data-root to /srv/docker; ..."}
    assert notes(row) == ["note: /etc/docker/daemon.json sets Docker's data-root to /srv/docker; ..."]
    assert notes({"host": "rig1", "data_root_left": None}) == []


def test_loading_saved_images_refuses_a_root_that_is_not_rigforges():
    """deploy/images_load.py reads only the images knobs: rigforge_root is checked there too (the images' work dir
    lies under it)."""
    from rigforge.model.knobs import images

    base = {"rigforge_images_dir": "/srv/saved"}
    assert images.validate(fleet.host_data(base)) == []
    (problem,) = images.validate(fleet.host_data({**base, "rigforge_root": "/var/lib/dpkg"}))
    assert problem.startswith("rigforge_root must be a directory of its own outside /var/lib/dpkg, dpkg's package")


def test_the_fact_sizes_a_data_root_left_but_not_the_one_in_use_under_another_name(tmp_path):
    """rigforge/observe/facts/docker.py DataRootLeft, its command run here: the old data-root's bytes; None when it does
    not exist, is a symlink, or is the data-root in use (the same directory)."""
    import subprocess

    from rigforge.observe.facts.docker import DataRootLeft

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "blob").write_bytes(b"\0" * 3_000_000)
    (tmp_path / "link").symlink_to(new)
    fact = DataRootLeft()

    def size(path, data_root) -> int | None:
        command = fact.command(str(path), str(data_root)).get_raw_value()
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
        return fact.process(done.stdout.splitlines())

    assert 3_000_000 <= size(old, new) < 3_100_000
    assert 3_000_000 <= size(old, tmp_path / "not-yet") < 3_100_000  # the new one not made yet
    assert size(tmp_path / "link", new) is None  # a symlink: nothing of its own to remove
    assert size(new, new) is None and size(new, tmp_path / "link") is None  # the one in use, under another name
    assert size(tmp_path / "gone", new) is None
