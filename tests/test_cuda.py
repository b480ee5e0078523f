"""CUDA compatibility, pure: NVIDIA's driver table, the driver's CUDA version from real nvidia-smi output
(tests/fixtures/nvidia-smi), the lock's `cuda` field and preflight's one-line refusal."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from rigforge.model.driver_table import branch_for_cuda, cuda_for_branch, cuda_for_driver
from rigforge.model.hardware import Needs, driver_cuda, find_problems, format_problems
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.pins import LockError, default_lock_path, dump_lock, load_lock, parse_lock
from rigforge.model.schema import Settings
from rigforge.observe.facts.nvidia import NvidiaRunningDriver, parse_cuda_version

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi"
H200 = FIXTURES / "h200x1-580.159.04-ubuntu2404"
UBUNTU = {"id": "ubuntu", "version_id": "24.04"}
DATA = {
    "docker_source": "docker",
    "nvidia_driver_flavor": "open",
    "nvidia_driver_branch": 580,
    "nvidia_driver_manage": True,
    "gpu_power_limit_w": 230,
}
IMAGE = "vllm/vllm-openai:v0.27.1"


def needs(cuda: str | None) -> Needs:
    return Needs("dual", 2, 23000, False, "/opt/rigforge/models", 0, IMAGE, cuda)


def preflight(data: dict, cuda: str | None, running: dict | None = None, os_release: dict = UBUNTU) -> list[str]:
    """find_problems on a rig whose driver shows no card yet, for an image built for `cuda`, with host data `data`."""
    knobs, settings = RoleKnobs.of(data), Settings()
    return find_problems(os_release, [], None, needs=needs(cuda), knobs=knobs, settings=settings, running=running)


@pytest.mark.parametrize(
    "branch, cuda", [(580, "13.0"), (590, "13.1"), (595, "13.2"), (575, "12.9"), (570, "12.8"), (535, "12.2")]
)
def test_each_branch_supports_the_cuda_of_nvidias_table(branch, cuda):
    assert cuda_for_branch(branch) == cuda


def test_driver_versions_and_branches_map_both_ways():
    assert cuda_for_driver("580.159.04") == "13.0"
    assert cuda_for_driver("595.71.05") == "13.2"
    assert cuda_for_driver("580.65.06") == "13.0" and cuda_for_driver("575.57.08") == "12.9"
    assert cuda_for_branch(610) is None  # newer than the table: unknown, never refused on a guess
    assert branch_for_cuda("13.2") == 595 and branch_for_cuda("13.0") == 580 and branch_for_cuda("13.1") == 590
    assert branch_for_cuda("13.9") is None


def test_the_header_of_real_nvidia_smi_output_carries_the_cuda_version():
    assert parse_cuda_version((H200 / "nvidia-smi.default.txt").read_text()) == "13.0"
    assert parse_cuda_version((FIXTURES / "h200x2-driver580" / "q-full.txt").read_text()) == "13.0"  # -q
    assert parse_cuda_version("No devices were found") is None


def test_the_running_driver_fact_reads_the_header(tmp_path):
    """The fact's own command, against an nvidia-smi that prints the real default output."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {H200 / 'nvidia-smi.default.txt'}\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["sh", "-c", NvidiaRunningDriver.command], env=env, capture_output=True, text=True)
    running = NvidiaRunningDriver().process(out.stdout.splitlines())
    assert running["smi_ok"] and running["cuda"] == "13.0"


def test_an_image_newer_than_the_branch_to_install_is_refused_in_one_line():
    (problem,) = preflight(DATA, "13.2")
    assert "\n" not in problem
    assert f"image {IMAGE} needs CUDA 13.2, driver branch 580 supports CUDA 13.0 at most" in problem
    assert "set nvidia_driver_branch: 595 (CUDA 13.2), or use an image built for CUDA <= 13.0." in problem
    message = format_problems("rig1", [problem])
    assert message.endswith("Nothing was changed on this host.")
    assert preflight({**DATA, "nvidia_driver_branch": 595}, "13.2") == []
    assert preflight(DATA, "13.0") == []
    assert preflight(DATA, None) == []  # unknown: not refused on a guess


def test_the_running_driver_counts_when_rigforge_keeps_it():
    running = NvidiaRunningDriver().process(
        ["proc=" + (H200 / "proc-version.txt").read_text().splitlines()[0], "smi_ok=1", "cuda=CUDA Version: 13.0"]
    )
    kept = {**DATA, "nvidia_driver_manage": False}
    assert driver_cuda(running, NvidiaDriver.of(kept)) == ("13.0", "the running driver 580.159.04")
    (problem,) = preflight(kept, "13.2", running)
    assert "the running driver 580.159.04 supports CUDA 13.0 at most" in problem
    assert "install driver branch 595 and set nvidia_driver_branch: 595" in problem
    # rigforge replaces a 580 driver with branch 595: the branch to install is what counts
    assert preflight({**DATA, "nvidia_driver_branch": 595}, "13.2", running) == []


def test_the_lock_records_each_images_cuda():
    lock = load_lock(default_lock_path())
    assert lock.image.cuda == "13.0" and lock.images["vllm-stable"].cuda == "13.0"
    assert lock.image_cuda(f"{IMAGE}@sha256:{'0' * 64}") == "13.0"  # pinned by digest: found by its ref
    assert lock.image_cuda("other/image:1") is None
    again = parse_lock(yaml.safe_load(dump_lock(lock)))
    assert again.images["vllm-stable"].cuda == "13.0"
    data = yaml.safe_load(dump_lock(lock))
    data["image"]["cuda"] = 13.2  # unquoted in YAML: a float, and 13.10 would read as 13.1
    with pytest.raises(LockError, match=r"image.cuda: expected a quoted CUDA version such as '13.0', got 13.2"):
        parse_lock(data)


class Rig:
    """An Observed answering NvidiaRunningDriver only (what the CUDA check reads)."""

    def __init__(self, running):
        self.running = running

    def get_fact(self, cls, **kwargs):
        assert cls is NvidiaRunningDriver
        return self.running


def test_verify_and_status_show_both_versions():
    from rigforge.model import fleet
    from rigforge.observe import drift, hosts

    plan, problems = fleet.plan_for("rig1", {"rigforge_variant": "dual-turbo"}, deployable=False)
    assert plan, problems
    ctx = hosts.RigContext(name="rig1", data=fleet.host_data({}), plan=plan, lock=plan.lock)
    running = {"version": "580.159.04", "smi": "/usr/bin/nvidia-smi", "smi_ok": True, "owner": None, "cuda": "13.0"}
    assert drift.cuda_versions(Rig(running), ctx) == {"driver": "13.0", "image": "13.0"}
    check = drift.cuda(Rig(running), ctx)
    assert (check.status, check.detail) == ("pass", "CUDA: driver 13.0, image 13.0")
    ctx.lock = dataclasses.replace(plan.lock, image=dataclasses.replace(plan.lock.image, cuda="13.2"))
    check = drift.cuda(Rig(running), ctx)
    assert check.status == "fail" and check.detail.startswith("CUDA: driver 13.0, image 13.2: the driver is too old")
    assert "set nvidia_driver_branch: 595" in check.detail
    assert drift.cuda(Rig({**running, "version": None, "cuda": None}), ctx).status == "fail"  # no driver running
