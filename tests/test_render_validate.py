"""Tier 3 with real tools: every rendered compose passes `docker compose config` (Debian 13's compose v2, no
engine needed) and the vLLM unit passes `systemd-analyze verify` with no output, inside a Debian 13 chroot.

The power unit and the settle stage are verified with nvidia-smi and the settle script at paths in the check dir.
"""

import json
import shutil
import subprocess

import pytest
from support import render_variant

from rigforge.model.catalog import load_catalog
from rigforge.model.schema import Settings, apply_overrides
from rigforge.testbed import tools_rootfs

pytestmark = pytest.mark.testbed
VARIANTS = list(load_catalog().variants)


@pytest.fixture(scope="module")
def tools(testbed_dir):
    root = tools_rootfs(testbed_dir)
    work = root / "rigforge-render-check"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    yield root
    shutil.rmtree(work, ignore_errors=True)


def in_tools(root, script):
    return subprocess.run(["chroot", str(root), "/bin/sh", "-c", script], capture_output=True, text=True)


def write(root, name, settings):
    d = root / "rigforge-render-check" / name
    d.mkdir(parents=True, exist_ok=True)
    for fname, text in render_variant(load_catalog().variants[name], settings).items():
        (d / fname).write_text(text)
    return f"/rigforge-render-check/{name}"


@pytest.mark.parametrize("name", VARIANTS)
def test_docker_compose_config_accepts_and_keeps_every_flag(tools, name):
    s = Settings(hf_token="hf_" + "t" * 34, api_key="k-123")
    d = write(tools, name, s)
    r = in_tools(tools, f"cd {d} && docker compose config --format json")
    assert r.returncode == 0, r.stderr
    variant = load_catalog().variants[name]
    svc = json.loads(r.stdout)["services"][variant.service]
    expected = [x for arg in variant.args for x in arg] + ["--api-key", "k-123"]
    assert svc["command"] == expected  # compose interpolated the key from .env
    assert svc["environment"]["HUGGING_FACE_HUB_TOKEN"] == ""  # the token is only with the weights download
    if variant.entrypoint:
        # config prints the file's canonical (re-escaped) form; at run time the container gets "$@"
        assert svc["entrypoint"][2].rstrip().endswith('exec vllm serve "$$@"')
    published = svc["ports"][0]
    assert (published["published"], published["target"]) == (str(variant.port), 8000)


def test_docker_compose_config_rejects_a_broken_file(tools):
    d = write(tools, "dual", Settings())
    compose = tools / d.lstrip("/") / "docker-compose.yml"
    compose.write_text(compose.read_text().replace("shm_size:", "shm_sise:"))
    r = in_tools(tools, f"cd {d} && docker compose config -q")
    assert r.returncode != 0 and "shm_sise" in r.stderr


@pytest.mark.parametrize("name", ["dual", "dual-turbo"])
def test_vllm_unit_passes_systemd_analyze_verify(tools, name):
    d = write(tools, name, apply_overrides(Settings(), {"root": "/srv/rigforge"}))
    r = in_tools(
        tools,
        f"cd {d} && cp 'rigforge-vllm@.service' 'rigforge-vllm@{name}.service' && "
        f"systemd-analyze verify ./rigforge-vllm@{name}.service",
    )
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


def test_systemd_analyze_verify_reports_a_bad_key(tools):
    d = write(tools, "dual", Settings())
    unit = tools / d.lstrip("/") / "rigforge-vllm@.service"
    unit.write_text(unit.read_text().replace("RestartSec=", "RestartSecs="))
    verify = "cp 'rigforge-vllm@.service' x@dual.service && systemd-analyze verify ./x@dual.service"
    r = in_tools(tools, f"cd {d} && {verify}")
    assert "RestartSecs" in r.stdout + r.stderr  # exits 0 on unknown keys: output is the failure signal


def test_the_power_unit_and_the_settle_stage_pass_systemd_analyze_verify_without_ordering_on_other_writers(tools):
    """Both boot units and the cap hold's unit and timer as a plan renders them (a rig with other cap writers
    changes nothing in them), with nvidia-smi and the scripts at paths inside the check dir (the tools root has no
    driver), and the settle and hold scripts pass `sh -n`."""
    from types import SimpleNamespace

    from rigforge.layout import HOLD_SCRIPT, HOLD_TIMER, HOLD_UNIT, POWER_UNIT, SETTLE_SCRIPT, SETTLE_UNIT
    from rigforge.model import fleet
    from rigforge.model.render import hold_files, render_power_unit, settle_files

    d = "/rigforge-render-check/boot"
    here = tools / d.lstrip("/")
    here.mkdir(parents=True, exist_ok=True)
    (here / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (here / "nvidia-smi").chmod(0o755)
    plan, problems = fleet.plan_for("r", {}, "dual", gpus=2, deployable=False, cap_units=("homemade-cap.service",))
    assert plan and not problems, problems
    assert plan.files[POWER_UNIT] == render_power_unit({0: 230, 1: 230})  # no After= on the other writer
    files = {POWER_UNIT: render_power_unit(plan.caps, nvidia_smi=f"{d}/nvidia-smi")}
    layout = SimpleNamespace(
        settle_script=f"{d}/{SETTLE_SCRIPT}", hold_script=f"{d}/{HOLD_SCRIPT}", cap_setbacks=f"{d}/setbacks"
    )
    files |= settle_files(plan.caps, 60, layout, f"{d}/nvidia-smi") | hold_files(plan.caps, layout, f"{d}/nvidia-smi")
    for name, text in files.items():
        (here / name).write_text(text)
    for script in (SETTLE_SCRIPT, HOLD_SCRIPT):
        (here / script).chmod(0o755)
        assert plan.files[script] == files[script]
    for name in (POWER_UNIT, SETTLE_UNIT, HOLD_UNIT, HOLD_TIMER):
        r = in_tools(tools, f"cd {d} && systemd-analyze verify ./{name}")
        assert r.returncode == 0 and r.stdout == "" and r.stderr == "", name + r.stdout + r.stderr
    for script in (SETTLE_SCRIPT, HOLD_SCRIPT):
        r = in_tools(tools, f"cd {d} && sh -n {script}")
        assert r.returncode == 0, r.stderr


def test_the_gpu_metrics_service_and_timer_pass_systemd_analyze_verify(tools):
    """The collector's oneshot and its 15 s timer as roles/monitor.py installs them, with the collector at a path
    inside the check dir (the tools root has no driver: nvidia-smi is a stub there too)."""
    from types import SimpleNamespace

    from rigforge.layout import GPU_METRICS_SCRIPT, GPU_METRICS_TIMER, GPU_METRICS_UNIT, TEXTFILE_DIR
    from rigforge.model.render import gpu_metrics_units, render_gpu_metrics

    d = "/rigforge-render-check/metrics"
    here = tools / d.lstrip("/")
    here.mkdir(parents=True, exist_ok=True)
    (here / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (here / GPU_METRICS_SCRIPT).write_text(render_gpu_metrics({0: 230, 1: 230}, "dual", "img"))
    for name in ("nvidia-smi", GPU_METRICS_SCRIPT):
        (here / name).chmod(0o755)
    layout = SimpleNamespace(gpu_metrics_script=f"{d}/{GPU_METRICS_SCRIPT}", textfile_dir=TEXTFILE_DIR)
    for name, text in gpu_metrics_units(layout, nvidia_smi=f"{d}/nvidia-smi").items():
        (here / name).write_text(text)
    for name in (GPU_METRICS_UNIT, GPU_METRICS_TIMER):
        r = in_tools(tools, f"cd {d} && systemd-analyze verify ./{name}")
        assert r.returncode == 0 and r.stdout == "" and r.stderr == "", name + r.stdout + r.stderr
    r = in_tools(tools, f"cd {d} && sh -n {GPU_METRICS_SCRIPT}")
    assert r.returncode == 0, r.stderr
