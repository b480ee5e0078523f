"""The GPU textfile collector (templates/rigforge-gpu-metrics.j2), rendered from a plan and run with a stand-in
nvidia-smi that answers in the real format, a fake sysfs PCI tree and a fake kernel log.

The stand-in's answer is cut from real output: tests/fixtures/nvidia-smi/h200x1-580.159.04-ubuntu2404/
monitor-query.csv (header) and monitor-query-nounits.csv (values), the collector's fields picked by name; the
fields it queries are checked against that driver's `--help-query-gpu`. The .prom file is read with a strict
parser of the text format below, and `promtool check metrics` (Debian's prometheus package, installed by .ci/run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from rigforge.layout import GPU_METRICS_FILE, TEXTFILE_DIR, HostLayout
from rigforge.model import fleet
from rigforge.model.render import render_gpu_metrics
from rigforge.testbed import RigSpec, aptrepo

H200 = Path(__file__).parent / "fixtures/nvidia-smi/h200x1-580.159.04-ubuntu2404"
FIELDS = (
    "index,power.draw,power.limit,temperature.gpu,utilization.gpu,memory.used,pcie.link.gen.current,"
    "pcie.link.width.current,pci.bus_id"
)
QUERY = [f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"]
XID = "NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def fixture_line(index: int, bus: str | None = None, **replace: str) -> str:
    """The H200's real answer to the collector's fields, as `--format=csv,noheader,nounits` prints it; `bus`: its
    PCI address as sysfs names it (nvidia-smi prints the domain in 8 digits, upper case)."""
    header = [h.split(" [")[0] for h in (H200 / "monitor-query.csv").read_text().splitlines()[0].split(", ")]
    values = (H200 / "monitor-query-nounits.csv").read_text().splitlines()[0].split(", ")
    row = dict(zip(header, values, strict=True)) | {"index": str(index)} | replace
    if bus:
        row["pci.bus_id"] = "0000" + bus.upper()
    return ", ".join(row[f] for f in FIELDS.split(","))


def stand_in(tmp_path: Path, output: str, rc: int = 0) -> Path:
    """An nvidia-smi that answers the collector's exact query with `output` (and rc), anything else like the real
    tool answers a bad field (rc 2)."""
    script = tmp_path / "bin/nvidia-smi"
    script.parent.mkdir(exist_ok=True)
    (tmp_path / "answer").write_text(output)
    bad_field = "echo 'Field \"bogus_field\" is not a valid field to query.'; exit 2"
    script.write_text(
        f'#!/bin/sh\n[ "$*" = "{" ".join(QUERY)}" ] || {{ {bad_field}; }}\ncat {tmp_path / "answer"}\nexit {rc}\n'
    )
    script.chmod(0o755)
    return script


def pci_tree(tmp_path: Path, devices: dict[str, tuple[str, str]]) -> Path:
    root = tmp_path / "sys"
    for address, (vendor, cls) in devices.items():
        d = root / "bus/pci/devices" / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    return root


TWO_GPUS = {
    "0000:01:00.0": ("0x10de", "0x030000"),  # VGA controller (a GeForce)
    "0000:01:00.1": ("0x10de", "0x040300"),  # its HDMI audio function: not a GPU
    "0000:02:00.0": ("0x10de", "0x030200"),  # 3D controller (an H200)
    "0000:00:02.0": ("0x8086", "0x030000"),  # the board's own VGA: not NVIDIA
}


def run_collector(
    tmp_path: Path, smi: Path, sysfs: Path, kernel_log: str = "", env: dict | None = None, setbacks: Path | None = None
) -> subprocess.CompletedProcess:
    """The collector as a plan renders it; `setbacks`: the cap hold's state file (default: none there)."""
    p, problems = fleet.plan_for("r", {"gpu_power_limits": {1: 250}}, "dual-turbo", gpus=2, deployable=False)
    assert not problems
    script = tmp_path / "rigforge-gpu-metrics"
    script.write_text(render_gpu_metrics(p.caps, p.variant.name, p.image, rest=p.knobs.serving.serving_rest))
    script.chmod(0o755)
    journalctl = tmp_path / "bin/journalctl"  # the kernel log of this boot
    journalctl.write_text(f"#!/bin/sh\n[ \"$*\" = '-k -b -q --no-pager' ] || exit 1\ncat <<'EOF'\n{kernel_log}EOF\n")
    journalctl.chmod(0o755)
    out = tmp_path / "textfile"
    out.mkdir(exist_ok=True)
    env = {**os.environ, **(env or {}), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    held = str(setbacks or tmp_path / "no-setbacks")
    return subprocess.run(
        ["sh", str(script), str(smi), str(out), str(sysfs), held], capture_output=True, text=True, env=env, timeout=60
    )


SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*)\})? (\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def parse(text: str) -> dict[str, dict]:
    """A strict reader of the text format: {family: {"type", "help", "samples": {labels tuple: float}}}. Every
    sample belongs to the family whose HELP and TYPE came just before it; a family appears once."""
    families: dict[str, dict] = {}
    current = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if m := re.fullmatch(r"# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)", line):
            assert m[1] not in families, f"family {m[1]} appears twice"
            current = families[m[1]] = {"help": m[2], "type": None, "samples": {}}
        elif m := re.fullmatch(r"# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)", line):
            assert current is families.get(m[1]) and current["type"] is None, line
            current["type"] = m[2]
        else:
            m = SAMPLE.fullmatch(line)
            assert m and current is families.get(m[1]) and current["type"], f"not a sample of the family above: {line}"
            labels = tuple(LABEL.findall(m[2] or ""))
            assert labels not in current["samples"], f"duplicate sample: {line}"
            current["samples"][labels] = float(m[3])
    return families


def value(families: dict, name: str, **labels: str) -> float:
    return families[name]["samples"][tuple(labels.items())]


def promtool_check_metrics(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run installs it)"
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_collector_queries_fields_the_driver_knows():
    known = set(re.findall(r'^"([a-z_.]+)"', (H200 / "help-query-gpu.txt").read_text(), re.M))
    assert set(FIELDS.split(",")) <= known
    assert f"--query-gpu={FIELDS}" in render_gpu_metrics({0: 230}, "v", "i")


def test_two_gpus_on_the_bus_and_in_nvidia_smi(tmp_path):
    busy = {
        "power.draw": "[N/A]",
        "power.limit": "250.00",
        "temperature.gpu": "61",
        "utilization.gpu": "87",
        "memory.used": "20480",
        "pcie.link.gen.current": "4",
        "pcie.link.width.current": "8",
    }
    answer = fixture_line(0, "0000:01:00.0") + "\n" + fixture_line(1, "0000:02:00.0", **busy) + "\n"
    old = tmp_path / "textfile" / GPU_METRICS_FILE
    old.parent.mkdir()
    old.write_text("rigforge_stale 1\n")
    before = time.time()
    r = run_collector(tmp_path, stand_in(tmp_path, answer), pci_tree(tmp_path, TWO_GPUS), f"boot\n{XID}\n{XID}\n")
    assert r.returncode == 0 and r.stdout == r.stderr == "", r
    assert sorted(p.name for p in old.parent.iterdir()) == [GPU_METRICS_FILE]  # replaced; no temp file left
    assert stat.S_IMODE(old.stat().st_mode) == 0o644  # the node exporter runs as the prometheus user
    text = old.read_text()
    promtool_check_metrics(text)
    m = parse(text)

    # the H200's real values (monitor-query-nounits.csv): 95.51 W of 700 W, 37 C, 0 %, 0 MiB, gen 5 x16
    assert value(m, "rigforge_gpu_power_draw_watts", gpu="0") == 95.51
    assert (("gpu", "1"),) not in m["rigforge_gpu_power_draw_watts"]["samples"]  # "[N/A]" is left out
    assert value(m, "rigforge_gpu_power_limit_watts", gpu="0") == 700
    assert value(m, "rigforge_gpu_power_limit_watts", gpu="1") == 250
    assert value(m, "rigforge_gpu_temperature_celsius", gpu="0") == 37
    assert value(m, "rigforge_gpu_utilization_ratio", gpu="0") == 0
    assert value(m, "rigforge_gpu_memory_used_bytes", gpu="0") == 0
    assert value(m, "rigforge_gpu_pcie_link_gen", gpu="0") == 5
    assert value(m, "rigforge_gpu_pcie_link_width", gpu="0") == 16
    # GPU1 under load (values replaced): ratio, bytes from MiB, the link it trained at
    assert value(m, "rigforge_gpu_temperature_celsius", gpu="1") == 61
    assert value(m, "rigforge_gpu_utilization_ratio", gpu="1") == 0.87
    assert value(m, "rigforge_gpu_memory_used_bytes", gpu="1") == 20480 * 1024 * 1024
    assert value(m, "rigforge_gpu_pcie_link_gen", gpu="1") == 4
    assert value(m, "rigforge_gpu_pcie_link_width", gpu="1") == 8
    # what rigforge declared: the plan's caps (230 W, GPU1 overridden to 250 W), variant and locked image
    assert value(m, "rigforge_gpu_declared_cap_watts", gpu="0") == 230
    assert value(m, "rigforge_gpu_declared_cap_watts", gpu="1") == 250
    [(labels, one)] = m["rigforge_declared_info"]["samples"].items()
    assert dict(labels)["variant"] == "dual-turbo" and dict(labels)["image"].startswith("vllm/") and one == 1
    assert dict(labels)["rest"] == ""
    assert value(m, "rigforge_gpus_pci") == 2 and value(m, "rigforge_gpus_visible") == 2
    assert value(m, "rigforge_gpu_present", gpu="0") == 1 == value(m, "rigforge_gpu_present", gpu="1")
    assert value(m, "rigforge_xid_errors_total") == 2 and m["rigforge_xid_errors_total"]["type"] == "counter"
    assert value(m, "rigforge_gpu_collector_success") == 1
    assert before - 1 <= value(m, "rigforge_gpu_collector_last_run_timestamp_seconds") <= time.time() + 1


def test_nvidia_smi_failing_still_writes_what_is_known(tmp_path):
    failed = (  # the real message (rc 9)
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
        "latest NVIDIA driver is installed and running.\n"
    )
    before = time.time()
    r = run_collector(tmp_path, stand_in(tmp_path, failed, rc=9), pci_tree(tmp_path, TWO_GPUS))
    assert r.returncode == 0, r
    text = (tmp_path / "textfile" / GPU_METRICS_FILE).read_text()
    promtool_check_metrics(text)
    m = parse(text)
    assert value(m, "rigforge_gpu_collector_success") == 0
    assert value(m, "rigforge_gpus_pci") == 2 and value(m, "rigforge_gpus_visible") == 0
    assert value(m, "rigforge_xid_errors_total") == 0
    assert value(m, "rigforge_gpu_declared_cap_watts", gpu="1") == 250
    assert m["rigforge_gpu_power_limit_watts"]["samples"] == {}  # nothing observed is made up
    assert m["rigforge_gpu_present"]["samples"] == {(("gpu", "0"),): 0, (("gpu", "1"),): 0}  # declared, not listed
    assert before - 1 <= value(m, "rigforge_gpu_collector_last_run_timestamp_seconds") <= time.time() + 1


def test_one_card_off_the_bus_for_nvidia_smi(tmp_path):
    """nvidia-smi lists the GPUs it still reaches, fails for the other: both counts are exported as seen."""
    answer = (
        fixture_line(0, "0000:01:00.0") + "\nUnable to determine the device handle for GPU0000:02:00.0: Unknown Error\n"
    )
    r = run_collector(tmp_path, stand_in(tmp_path, answer, rc=15), pci_tree(tmp_path, TWO_GPUS))
    assert r.returncode == 0, r
    m = parse((tmp_path / "textfile" / GPU_METRICS_FILE).read_text())
    assert value(m, "rigforge_gpus_pci") == 2 and value(m, "rigforge_gpus_visible") == 1
    assert value(m, "rigforge_gpu_collector_success") == 0
    assert value(m, "rigforge_gpu_power_limit_watts", gpu="0") == 700
    # the card nvidia-smi no longer lists is named: declared, not present, and none of its values is exported
    assert m["rigforge_gpu_present"]["samples"] == {(("gpu", "0"),): 1, (("gpu", "1"),): 0}
    assert value(m, "rigforge_gpu_declared_cap_watts", gpu="1") == 250
    observed = ("power_draw_watts", "power_limit_watts", "temperature_celsius", "utilization_ratio")
    observed += ("memory_used_bytes", "pcie_link_gen", "pcie_link_width")
    assert all(set(m[f"rigforge_gpu_{name}"]["samples"]) == {(("gpu", "0"),)} for name in observed)


def test_a_card_gone_from_nvidia_smi_is_named_by_its_place_on_the_bus_when_nvidia_smi_numbers_the_rest_again(tmp_path):
    """GPU 0 (0000:01:00.0) gone after a reboot: nvidia-smi lists the other card as its index 0. The collector labels
    each card by its place in PCI bus order, so GPU 0 is the missing one and GPU 1's values stay GPU 1's (by
    nvidia-smi's index, the page would call GPU 1 missing and show GPU 1's values as GPU 0's)."""
    answer = fixture_line(0, "0000:02:00.0", **{"power.limit": "250.00"}) + "\n"
    r = run_collector(tmp_path, stand_in(tmp_path, answer), pci_tree(tmp_path, TWO_GPUS))
    assert r.returncode == 0, r
    m = parse((tmp_path / "textfile" / GPU_METRICS_FILE).read_text())
    assert m["rigforge_gpu_present"]["samples"] == {(("gpu", "0"),): 0, (("gpu", "1"),): 1}
    assert m["rigforge_gpu_power_limit_watts"]["samples"] == {(("gpu", "1"),): 250}
    assert value(m, "rigforge_gpus_pci") == 2 and value(m, "rigforge_gpus_visible") == 1


def stand_in_smi(tmp_path: Path) -> tuple[Path, Path]:
    """The testbed's stand-in nvidia-smi (rigforge/testbed/stubs/nvidia-smi) installed under tmp_path, and the root
    it simulates (RIGFORGE_SIM_ROOT): two RTX 3090s at their default 350 W."""
    sim = tmp_path / "sim"
    (sim / "etc/rigforge-sim").mkdir(parents=True)
    (sim / "etc/rigforge-sim/gpus.json").write_text(json.dumps(RigSpec().gpus_json("t")))
    (sim / "sys/module/nvidia").mkdir(parents=True)
    (sim / "sys/module/nvidia/version").write_text(aptrepo.DRIVER_VERSION + "\n")
    smi = tmp_path / "bin/nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(aptrepo.stub_script("nvidia-smi", DRIVER_VERSION=aptrepo.DRIVER_VERSION, FLAVOR="open"))
    smi.chmod(0o755)
    return smi, sim


def test_the_testbeds_stand_in_nvidia_smi_answers_the_collector(tmp_path):
    """The testbed's stub nvidia-smi (rigforge/testbed/stubs/nvidia-smi), run on the controller under
    RIGFORGE_SIM_ROOT: two RTX 3090s at their default 350 W, on a PCI bus shaped like the booted rigs' one."""
    smi, sim = stand_in_smi(tmp_path)
    r = run_collector(tmp_path, smi, pci_tree(tmp_path, TWO_GPUS), env={"RIGFORGE_SIM_ROOT": str(sim)})
    assert r.returncode == 0, r
    m = parse((tmp_path / "textfile" / GPU_METRICS_FILE).read_text())
    assert value(m, "rigforge_gpu_collector_success") == 1
    assert value(m, "rigforge_gpus_visible") == 2 == value(m, "rigforge_gpus_pci")
    for gpu in ("0", "1"):
        assert value(m, "rigforge_gpu_power_limit_watts", gpu=gpu) == 350
        assert value(m, "rigforge_gpu_memory_used_bytes", gpu=gpu) == 0
        assert value(m, "rigforge_gpu_pcie_link_gen", gpu=gpu) == 4
        assert value(m, "rigforge_gpu_pcie_link_width", gpu=gpu) == 16
    assert set(m["rigforge_gpu_temperature_celsius"]["samples"]) == {(("gpu", "0"),), (("gpu", "1"),)}


def test_the_stand_ins_cap_writers_racing_at_boot_all_succeed_and_none_is_lost(tmp_path):
    """At boot four units may run `nvidia-smi -pl` at once (test_booted_boot_order). NVML serializes them; the
    stand-in did not, and a writer failed when another had moved the shared temp file into place."""
    smi, sim = stand_in_smi(tmp_path)
    env = {**os.environ, "RIGFORGE_SIM_ROOT": str(sim)}
    writers = [[str(smi), "-i", str(i % 2), "-pl", str(200 + i)] for i in range(24)] + [[str(smi), "-pm", "1"]]
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for argv in writers
    ]
    failed = [(p.args, p.communicate()[0]) for p in procs if p.wait() != 0]
    assert failed == []
    state = json.loads((sim / "var/lib/rigforge-sim/state.json").read_text())
    assert state["0"]["persistence"] is True and state["1"]["persistence"] is True
    assert {state["0"]["power_limit"], state["1"]["power_limit"]} <= {200.0 + i for i in range(24)}


def test_label_values_are_quoted_and_paths_come_from_the_layout():
    script = render_gpu_metrics({0: 230}, 'a"b\\c', "img\nx", rest="stopped")
    assert 'rigforge_declared_info{variant="a\\"b\\\\c",image="img\\nx",rest="stopped"} 1\n' in script
    assert f"dir=${{2:-{TEXTFILE_DIR}}}\n" in script and HostLayout().textfile_dir == TEXTFILE_DIR
    assert HostLayout().gpu_metrics_script == "/usr/local/lib/rigforge/rigforge-gpu-metrics"


@pytest.mark.parametrize("shell", ["sh", "dash", "bash"])
def test_the_script_is_posix_sh(shell):
    if not shutil.which(shell):
        pytest.skip(f"no {shell}")
    r = subprocess.run([shell, "-n"], input=render_gpu_metrics({0: 230}, "v", "i"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_timer_runs_the_installed_collector_every_15_s_into_the_textfile_dir():
    from rigforge.layout import GPU_METRICS_TIMER, GPU_METRICS_UNIT, HostLayout
    from rigforge.model.render import gpu_metrics_units

    layout = HostLayout()
    units = gpu_metrics_units(layout)
    assert set(units) == {GPU_METRICS_UNIT, GPU_METRICS_TIMER}
    exec_start = f"ExecStart={layout.gpu_metrics_script} /usr/bin/nvidia-smi {layout.textfile_dir}\n"
    assert exec_start in units[GPU_METRICS_UNIT] and "Type=oneshot\n" in units[GPU_METRICS_UNIT]
    timer = units[GPU_METRICS_TIMER]
    assert "OnUnitActiveSec=15s\n" in timer and "OnBootSec=15s\n" in timer and "WantedBy=timers.target" in timer
