"""The simulated nvidia-smi / nvidia-ctk against the real tools' formats (tests/fixtures/nvidia-smi, driver 580).

These run the stub scripts on the controller with RIGFORGE_SIM_ROOT (no rig needed); the rig tests run the
installed package over SSH.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rigforge.testbed import RigSpec, aptrepo

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi" / "h200x2-driver580"
QUERY_FIELDS = (
    "index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,power.limit,power.default_limit,"
    "power.min_limit,power.max_limit,enforced.power.limit,power.draw,persistence_mode,driver_version,"
    "compute_cap,temperature.gpu,clocks.max.sm"
)
UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture
def smi(tmp_path):
    """Run the stub nvidia-smi against a simulated 2x RTX 3090 root in tmp_path."""
    script = tmp_path / "nvidia-smi"
    script.write_text(aptrepo.stub_script("nvidia-smi", DRIVER_VERSION=aptrepo.DRIVER_VERSION, FLAVOR="open"))
    (tmp_path / "etc/rigforge-sim").mkdir(parents=True)
    (tmp_path / "etc/rigforge-sim/gpus.json").write_text(json.dumps(RigSpec().gpus_json("t")))
    (tmp_path / "sys/module/nvidia").mkdir(parents=True)
    (tmp_path / "sys/module/nvidia/version").write_text(aptrepo.DRIVER_VERSION + "\n")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), *args],
            env={"RIGFORGE_SIM_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )

    run.root = tmp_path
    return run


def shape(value: str) -> str:
    """The format of a value with numbers and flags abstracted: '700.00 W' -> '9.9 W', 'Enabled' -> 'flag'."""
    if value.strip() in ("Enabled", "Disabled"):
        return "flag"
    return re.sub(r"\d+(\.\d+)?", lambda m: "9.9" if m.group(1) else "9", value.strip())


def rows(text: str) -> list[list[str]]:
    return [line.split(", ") for line in text.strip().splitlines()]


def test_query_gpu_header_format_matches_real_tool(smi):
    res = smi(f"--query-gpu={QUERY_FIELDS}", "--format=csv")
    assert res.returncode == 0, res.stdout
    ours, real = rows(res.stdout), rows((FIX / "query-gpu-header.csv").read_text())
    assert ours[0] == real[0]  # the header line, units in brackets, is identical
    assert len(ours) == 3  # header + 2 GPUs
    for our_row in ours[1:]:
        assert len(our_row) == len(real[1])
        for name, ours_v, real_v in zip(ours[0], our_row, real[1], strict=True):
            if name == "uuid":
                assert UUID.match(ours_v) and UUID.match(real_v)
            elif name != "name":
                assert shape(ours_v) == shape(real_v), f"{name}: {ours_v!r} vs real {real_v!r}"
    assert ours[1][2] == "NVIDIA GeForce RTX 3090"
    assert ours[1][4] == "24576 MiB" and ours[1][7] == "350.00 W" and ours[1][9] == "100.00 W"


def test_query_gpu_noheader_nounits_matches_real_tool(smi):
    res = smi(f"--query-gpu={QUERY_FIELDS}", "--format=csv,noheader,nounits")
    assert res.returncode == 0
    ours, real = rows(res.stdout), rows((FIX / "query-gpu.csv").read_text())
    assert len(ours) == 2
    for i, (ours_v, real_v) in enumerate(zip(ours[0], real[0], strict=True)):
        if i not in (1, 2):  # uuid, name
            assert shape(ours_v) == shape(real_v)
    assert ours[0][13] == "Disabled" and ours[0][14] == "580.159.04" and ours[0][15] == "8.6"


def test_list_gpus_matches_real_format(smi):
    pattern = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9a-f-]+)\)$")
    real = (FIX / "nvidia-smi-L.txt").read_text().splitlines()
    assert all(pattern.match(line) for line in real)
    ours = smi("-L").stdout.splitlines()
    assert [pattern.match(line).group(1, 2) for line in ours] == [
        ("0", "NVIDIA GeForce RTX 3090"),
        ("1", "NVIDIA GeForce RTX 3090"),
    ]
    assert smi("-L", "-i", "1").stdout.startswith("GPU 1: ")


def test_unknown_field_exits_2_with_real_message(smi):
    real = (FIX / "query-bad-field.txt").read_text()
    real_rc = int(re.search(r"rc_bad=(\d+)", real).group(1))
    res = smi("--query-gpu=index,bogus_field", "--format=csv")
    assert res.returncode == real_rc == 2
    assert res.stdout.strip() == real.split("rc_bad")[0].strip()


def test_missing_index_exits_6_with_real_message(smi):
    real = (FIX / "query-bad-index.txt").read_text()
    real_rc = int(re.search(r"rc_badidx=(\d+)", real).group(1))
    res = smi("-i", "7", "--query-gpu=index", "--format=csv")
    assert res.returncode == real_rc == 6
    assert res.stdout.strip() == real.split("rc_badidx")[0].strip() == "No devices were found"


def _q_structure(text: str) -> list[tuple[str, str]]:
    """(key, value shape) per line of `nvidia-smi -q` output, GPU blocks only, bus ids abstracted."""
    out = []
    for line in text.split("Attached GPUs", 1)[1].splitlines()[1:]:
        key, _, value = line.partition(":")
        if line.startswith("GPU "):
            out.append(("GPU <bus>", ""))
        else:
            out.append((key.rstrip(), "N/A" if value.strip() == "N/A" else shape(value)))
    return out


def test_q_power_has_the_real_layout(smi):
    ours = smi("-q", "-d", "POWER")
    assert ours.returncode == 0
    real = (FIX / "q-power.txt").read_text()
    ours_s, real_s = _q_structure(ours.stdout), _q_structure(real)
    assert [k for k, _ in ours_s] == [k for k, _ in real_s]
    for (key, ours_v), (_, real_v) in zip(ours_s, real_s, strict=True):
        if ours_v != "N/A" and real_v != "N/A":
            assert ours_v == real_v, key
    assert "Max Power Limit                                : 350.00 W" in ours.stdout
    assert "Min Power Limit                                : 100.00 W" in ours.stdout


def test_version_matches_real_layout(smi):
    real = (FIX / "misc.txt").read_text().split("+ nvidia-smi --version\n", 1)[1].split("+ echo")[0].strip()
    assert smi("--version").stdout.strip() == real  # same driver version 580.159.04, same CUDA 13.0


def test_plain_table_has_the_real_frame(smi):
    ours = smi().stdout.splitlines()
    real = (FIX / "plain.txt").read_text().splitlines()
    assert [len(line.rstrip()) for line in ours[1:8]] == [len(line.rstrip()) for line in real[1:8]]
    assert ours[3:8] == real[3:8]  # column headers
    gpu_lines = [line for line in ours if "NVIDIA GeForce RTX 3090" in line]
    assert len(gpu_lines) == 2 and all(len(line) == 91 for line in gpu_lines)


def test_plain_header_carries_the_branchs_cuda_version_as_the_real_tool(smi, tmp_path):
    from rigforge.observe.facts.nvidia import parse_cuda_version

    real = (FIX / "plain.txt").read_text().splitlines()
    assert smi().stdout.splitlines()[2] == real[2]  # "| NVIDIA-SMI 580.159.04 ... CUDA Version: 13.0     |"
    later = tmp_path / "nvidia-smi-590"
    later.write_text(aptrepo.stub_script("nvidia-smi", DRIVER_VERSION=aptrepo.NEXT_DRIVER_VERSION, FLAVOR="open"))
    (smi.root / "sys/module/nvidia/version").write_text(aptrepo.NEXT_DRIVER_VERSION + "\n")
    out = subprocess.run(
        [sys.executable, str(later)], env={"RIGFORGE_SIM_ROOT": str(smi.root)}, capture_output=True, text=True
    ).stdout
    assert parse_cuda_version(out) == "13.1"  # branch 590: CUDA 13.1, as NVIDIA's table says


def test_driver_not_loaded_and_version_mismatch(smi):
    (smi.root / "sys/module/nvidia/version").write_text("575.57.08\n")
    res = smi("-L")
    assert res.returncode == 18 and "Driver/library version mismatch" in res.stdout
    (smi.root / "sys/module/nvidia/version").unlink()
    res = smi("-L")
    assert res.returncode == 9 and "couldn't communicate with the NVIDIA driver" in res.stdout


def test_nvidia_ctk_merges_daemon_json_keeping_keys(tmp_path):
    script = tmp_path / "nvidia-ctk"
    script.write_text(aptrepo.stub_script("nvidia-ctk", TOOLKIT_VERSION=aptrepo.TOOLKIT_VERSION))
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"log-driver": "json-file", "runtimes": {"other": {"path": "/x"}}}))
    res = subprocess.run(
        [sys.executable, str(script), "runtime", "configure", "--runtime=docker", f"--config={cfg}"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(cfg.read_text()) == {
        "log-driver": "json-file",
        "runtimes": {"other": {"path": "/x"}, "nvidia": {"args": [], "path": "nvidia-container-runtime"}},
    }
    before = cfg.read_text()
    subprocess.run([sys.executable, str(script), "runtime", "configure", "--runtime=docker", f"--config={cfg}"])
    assert cfg.read_text() == before  # idempotent
    ver = subprocess.run([sys.executable, str(script), "--version"], capture_output=True, text=True)
    assert ver.stdout.startswith(f"NVIDIA Container Toolkit CLI version {aptrepo.TOOLKIT_VERSION}")


def test_topo_matches_the_real_tools_format_for_two_pcie_gpus(smi):
    """`topo -m` and `topo -p2p r` as the real tool prints them (h200x2 misc.txt, h200x1 topo-*.txt: tabs,
    the underlined header, the legend), for a 2x 3090 PCIe rig: PHB, no NVLink, P2P refused (CNS)."""
    from rigforge.observe.facts.nvidia import parse_topo_matrix

    real_m = (FIX / "misc.txt").read_text().split("+ echo ---")[0].splitlines()[1:]
    res = smi("topo", "-m")
    assert res.returncode == 0, res.stdout
    ours = res.stdout.splitlines()
    assert ours[0] == real_m[0] and ours[3:] == real_m[3:]  # header (2 GPUs both) and legend verbatim
    assert ours[1] == "GPU0\t X \tPHB\t0-15\t0\t\tN/A" and ours[2] == "GPU1\tPHB\t X \t0-15\t0\t\tN/A"
    assert parse_topo_matrix(ours) == {"0-1": "PHB"}

    real_p2p = (FIX.parent / "h200x1-580.159.04-ubuntu2404" / "topo-p2p-r.txt").read_text().splitlines()
    res = smi("topo", "-p2p", "r")
    assert res.returncode == 0, res.stdout
    ours = res.stdout.splitlines()
    assert ours[:3] == [" \t\x1b[4mGPU0\tGPU1\t\x1b[0m", " GPU0\tX\tCNS\t", " GPU1\tCNS\tX\t"]
    assert ours[3:] == real_p2p[2:]  # the legend
    assert real_p2p[:2] == [" \t\x1b[4mGPU0\t\x1b[0m", " GPU0\tX\t"]  # the real one-GPU form of the same rows
    assert parse_topo_matrix(ours) == {"0-1": "CNS"}
    assert smi("topo", "-x").returncode == 2


def test_a_card_off_the_bus_is_named_the_others_answer_and_the_exit_is_15(smi):
    """state.json "lost": [1] is GPU1 fallen off the bus (Xid 79): NVML cannot get its handle, the tool says so
    and answers for GPU0, and exits 15, the man page's "GPU has fallen off the bus or has otherwise become
    inaccessible"."""
    state = smi.root / "var/lib/rigforge-sim/state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"lost": [1]}))
    res = smi("--query-gpu=index,power.limit", "--format=csv,noheader,nounits")
    assert res.returncode == 15
    lines = res.stdout.splitlines()
    assert lines[0] == "Unable to determine the device handle for GPU0000:02:00.0: Unknown Error"
    assert [line.split(", ")[0] for line in lines[1:]] == ["0"]
    state.write_text(json.dumps({}))
    assert smi("--query-gpu=index", "--format=csv,noheader").stdout.split() == ["0", "1"]
