"""Any card count the recipe names (issue 50): a slug's `tp` is how many GPUs it needs; a rig with more serves it on
its first `tp` cards and leaves the others idle; requires_nvlink / requires_homogeneous_arch on 4- and 8-card
topologies (real `nvidia-smi topo -m` captures, tests/fixtures/nvidia-smi/topo-*); power for every card and the
power supply (gpu_psu_watts); the testbed's simulated nvidia-smi for N cards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import render_variant
from test_recipes import IMAGE, REFERENCE

from rigforge.model import power, recipes
from rigforge.model.catalog import load_catalog
from rigforge.model.hardware import (
    Needs,
    find_problems,
    format_problems,
    gpu_problems,
    interconnect,
    interconnect_problems,
    serving_env,
    serving_indices,
)
from rigforge.model.knobs import gpu_power as gpu_power_knobs
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.recipes import parse_repo
from rigforge.model.schema import Settings
from rigforge.observe.facts.nvidia import parse_topo_matrix, parse_topology

SMI = Path(__file__).resolve().parent / "fixtures" / "nvidia-smi"
MULTI4 = (
    "vllm/qwen-27b-multi-fast",
    "vllm/qwen-27b-multi-max",
    "vllm/gemma-31b-multi-google-qat-w4a16",
    "vllm/nemotron-75b-multi-mtp",
)
DATA = {"gpu_power_limit_w": 230, "gpu_power_limits": {}}
POWER, SETTINGS = gpu_power_knobs.GpuPower.of(DATA), Settings()  # the caps every card gets; no 20 GB override
UBUNTU = {"id": "ubuntu", "version_id": "24.04"}


@pytest.fixture(scope="module")
def repo():
    return parse_repo(REFERENCE)


def card(index: int, cap: str = "8.6", mib: int = 24576) -> dict:
    """One GPU as NvidiaGpus reads it (an RTX 3090 unless told)."""
    return {
        "index": index,
        "name": "NVIDIA GeForce RTX 3090",
        "pci_bus_id": f"00000000:{index + 1:02X}:00.0",
        "memory_total": mib,
        "power_min_limit": 100.0,
        "power_max_limit": 350.0,
        "compute_cap": cap,
    }


def needs(gpus: int, nvlink: bool = False, homogeneous: bool = False) -> Needs:
    """What vllm/qwen-27b-multi-fast needs over `gpus` cards, with the recipe's interconnect keys."""
    models = "/opt/rigforge/models"
    return Needs("vllm-qwen-27b-multi-fast", gpus, 24000, False, models, 0, nvlink=nvlink, homogeneous=homogeneous)


def matrix(name: str) -> list[str]:
    return (SMI / name / "topo-m.txt").read_text().splitlines()


# --- the count: a slug's tp is how many GPUs it needs ---


def test_the_four_tp4_slugs_are_served_and_need_four_gpus(repo):
    for slug in MULTI4:
        r = repo.recipe(slug)
        assert r.refused is None and r.tp == 4 and r.extra["requires_nvlink"] is False
    assert repo.recipes["vllm/nemotron-75b-multi-mtp"].extra["requires_homogeneous_arch"] is True


def test_the_tp4_slugs_render_flag_for_flag_as_the_recipes_composes(repo):
    """Rendered for the 4-card rig they need: command (--tensor-parallel-size 4), entrypoint, environment, devices
    are the recipe's own, interpolated with its defaults; no card pin (the rig has exactly 4)."""
    for slug in MULTI4:
        r = repo.recipe(slug)
        upstream = repo.compose(r)
        name = recipes.service_name(r, upstream)
        up = recipes.interpolated(upstream, {})["services"][name]
        files = render_variant(recipes.of(repo, r, IMAGE), Settings(), 4)
        svc = recipes._walk(yaml.safe_load(files[recipes.EFFECTIVE_FILE]), lambda s: s.replace("$$", "$"))
        svc = svc["services"][name]
        for key in ("command", "entrypoint", "environment", "deploy", "ipc", "shm_size", "container_name"):
            assert svc.get(key) == up.get(key), (slug, key)
        assert svc["command"][svc["command"].index("--tensor-parallel-size") + 1] == "4", slug
        assert "environment" not in yaml.safe_load(files[recipes.OVERRIDE_FILE])["services"][name], slug


def test_a_two_card_rig_is_refused_a_tp4_slug_naming_both_counts():
    problems = gpu_problems([card(0), card(1)], needs(4), POWER, SETTINGS)
    assert problems == [
        "variant vllm-qwen-27b-multi-fast needs 4 GPUs, nvidia-smi shows 2; this rig has 2 GPU(s) and the variant "
        "runs tensor-parallel over 4: add 2 GPU(s), or choose a variant for at most 2 card(s) (a slug's tp in the "
        "recipe registry is how many it needs)."
    ]
    knobs, pci = RoleKnobs.of(DATA), [("0000:01:00.0", "2204")] * 2
    before_driver = find_problems(UBUNTU, [], None, needs=needs(4), knobs=knobs, settings=SETTINGS, pci=pci)
    assert "needs 4 GPUs, the PCI bus shows 2 NVIDIA GPU(s); this rig has 2 GPU(s)" in before_driver[0]
    message = format_problems("rig1", problems)
    assert message.startswith("preflight failed on rig1:") and message.endswith("Nothing was changed on this host.")


def test_four_and_eight_cards_fit_their_slugs():
    assert gpu_problems([card(i) for i in range(4)], needs(4), POWER, SETTINGS) == []
    assert gpu_problems([card(i) for i in range(8)], needs(8), POWER, SETTINGS) == []


# --- a rig with more cards than the slug's tp: the first tp serve, the others idle ---


def test_a_slug_over_fewer_cards_runs_on_the_first_ones_in_pci_bus_order():
    assert serving_indices(2, 4) == [0, 1] and serving_indices(4, 4) == [0, 1, 2, 3] and serving_indices(1, 2) == [0]
    assert serving_env(2, 4) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert serving_env(2, 2) == {} and serving_env(4, 4) == {} and serving_env(2, None) == {}


def test_a_tp2_slug_on_a_four_card_rig_pins_cards_0_and_1_and_caps_all_four(repo):
    r = repo.recipe("vllm/dual")
    files = render_variant(recipes.of(repo, r, IMAGE), Settings(), 4)
    name = recipes.service_name(r, repo.compose(r))
    override = yaml.safe_load(files[recipes.OVERRIDE_FILE])["services"][name]
    assert override["environment"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}
    env = yaml.safe_load(files[recipes.EFFECTIVE_FILE])["services"][name]["environment"]
    assert env[-2:] == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0,1"]
    assert "CUDA_VISIBLE_DEVICES" not in env  # the recipe's bare passthrough is replaced, not doubled
    cmd = yaml.safe_load(files[recipes.EFFECTIVE_FILE])["services"][name]["command"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert all(f"-i {i} -pl 230" in files["rigforge-gpu-power.service"] for i in range(4))  # idle cards capped too
    for unit in ("rigforge-gpu-settle.service", "rigforge-gpu-hold.service"):  # the settle stage and the hold
        assert " 0:230 1:230 2:230 3:230\n" in files[unit], unit
    two = render_variant(recipes.of(repo, r, IMAGE), Settings(), 2)
    assert "environment" not in yaml.safe_load(two[recipes.OVERRIDE_FILE])["services"][name]


def test_a_seed_variant_on_a_four_card_rig_is_pinned_the_same_way():
    variant = load_catalog().variants["dual"]
    compose = yaml.safe_load(render_variant(variant, Settings(), 4)["docker-compose.yml"])
    env = next(iter(compose["services"].values()))["environment"]
    assert (env["CUDA_DEVICE_ORDER"], env["CUDA_VISIBLE_DEVICES"]) == ("PCI_BUS_ID", "0,1")
    compose = yaml.safe_load(render_variant(variant, Settings(), 2)["docker-compose.yml"])
    assert "CUDA_VISIBLE_DEVICES" not in next(iter(compose["services"].values()))["environment"]


def test_vram_is_checked_on_the_cards_a_slug_runs_on():
    small = [card(0), card(1), card(2, mib=12288), card(3, mib=12288)]  # two 3060s beside two 3090s
    assert gpu_problems(small, needs(2), POWER, SETTINGS) == []  # TP=2 runs on GPU 0 and 1
    assert "GPU 2, 3 (NVIDIA GeForce RTX 3090) have 12288 MiB" in gpu_problems(small, needs(4), POWER, SETTINGS)[0]


# --- the interconnect: requires_nvlink and requires_homogeneous_arch on 4- and 8-card topologies ---


def test_topo_m_of_four_gpus_nvlinked_in_pairs_across_two_sockets():
    """topo-4gpu-nv3-pairs-2socket: NV3 inside each pair, SYS across the sockets; the mlx5_N NIC columns skipped."""
    links = parse_topo_matrix(matrix("topo-4gpu-nv3-pairs-2socket"))
    assert links == {"0-1": "NV3", "0-2": "SYS", "0-3": "SYS", "1-2": "SYS", "1-3": "SYS", "2-3": "NV3"}
    assert interconnect({"links": links}) == "PCIe (SYS), NVLink (NV3)"
    problems = interconnect_problems({"links": links}, needs(4, nvlink=True), 4)
    assert problems == [
        "variant vllm-qwen-27b-multi-fast requires NVLink between its 4 cards (the recipe's requires_nvlink), "
        "`nvidia-smi topo -m` shows GPU 0-2 SYS, GPU 0-3 SYS, GPU 1-2 SYS, GPU 1-3 SYS (no NVLink): bridge them, "
        "or choose a slug that does not require it."
    ]
    assert interconnect_problems({"links": links}, needs(2, nvlink=True), 4) == []  # TP=2 on the NV3 pair 0-1
    assert interconnect_problems({"links": links}, needs(4), 4) == []  # not required (every slug of 4a29ab57)


def test_topo_m_of_five_pcie_gpus_on_two_sockets():
    """topo-5gpu-pcie-2socket (club-3090 #46): SYS, PHB and NODE on one rig, no NVLink."""
    links = parse_topo_matrix(matrix("topo-5gpu-pcie-2socket"))
    assert len(links) == 10 and links["0-4"] == "SYS" and links["1-2"] == "PHB" and links["1-3"] == "NODE"
    assert interconnect({"links": links}) == "PCIe (NODE/PHB/SYS), no NVLink"
    assert "GPU 0-1 SYS, GPU 0-2 SYS" in interconnect_problems({"links": links}, needs(4, nvlink=True), 5)[0]


def test_topo_m_of_eight_nvswitch_gpus():
    """topo-8gpu-nvswitch-nv18: every pair NV18, so requires_nvlink holds at TP 2, 4 and 8."""
    links = parse_topo_matrix(matrix("topo-8gpu-nvswitch-nv18"))
    assert len(links) == 28 and set(links.values()) == {"NV18"}
    assert interconnect({"links": links}) == "NVLink (NV18)"
    for tp in (2, 4, 8):
        assert interconnect_problems({"links": links}, needs(tp, nvlink=True), 8) == []


def test_nvlink_is_asked_only_when_the_driver_answers():
    assert interconnect_problems(None, needs(4, nvlink=True), 4) == []  # checked again once the driver answers
    topology = {"links": {"0-1": "PHB", "0-2": "PHB", "0-3": "PHB", "1-2": "PHB", "1-3": "PHB", "2-3": "PHB"}}
    problems = gpu_problems([card(i) for i in range(4)], needs(4, nvlink=True), POWER, SETTINGS, topology=topology)
    assert len(problems) == 1 and "requires NVLink between its 4 cards" in problems[0]


def test_a_homogeneous_slug_is_refused_mixed_architectures_on_its_cards():
    mixed = [card(0), card(1), card(2), card(3, cap="8.9")]  # a 4090 as the fourth card
    problems = gpu_problems(mixed, needs(4, homogeneous=True), POWER, SETTINGS)
    assert problems == [
        "variant vllm-qwen-27b-multi-fast requires one GPU architecture across its 4 cards (the recipe's "
        "requires_homogeneous_arch: its arch-gated kernels fail on the lower card), the cards span compute "
        "capabilities 8.6, 8.9 (GPU 0 sm_8.6, GPU 1 sm_8.6, GPU 2 sm_8.6, GPU 3 sm_8.9): serve it on cards of one "
        "architecture."
    ]
    assert gpu_problems(mixed, needs(4), POWER, SETTINGS) == []  # not required
    # TP=2 runs on GPU 0 and 1, both sm_8.6
    assert gpu_problems(mixed, needs(2, homogeneous=True), POWER, SETTINGS) == []


# --- power: every card, and the power supply ---


def test_the_psu_warning_sums_every_cards_cap():
    caps = {0: 330, 1: 330, 2: 330, 3: 330}
    warning = power.psu_warning(caps, 1200)
    assert warning == (
        "the power caps of this rig's 4 GPUs add up to 1320 W (GPU 0 330 W + GPU 1 330 W + GPU 2 330 W + GPU 3 330 W), "
        "more than the 1200 W gpu_psu_watts says the power supply gives the GPUs: under full load the supply can trip "
        "or the rig reset; set gpu_power_limit_w to at most 300 W, or correct gpu_psu_watts (kept as set)"
    )
    assert power.psu_warning(caps, 1320) is None and power.psu_warning(caps, None) is None
    assert power.psu_warning({0: 230, 1: 230}, 400) is not None


def test_gpu_psu_watts_is_whole_watts_or_null():
    assert gpu_power_knobs.DEFAULTS["gpu_psu_watts"] is None
    assert gpu_power_knobs.validate({"gpu_psu_watts": 1600}) == []
    assert gpu_power_knobs.validate({"gpu_psu_watts": None}) == []
    assert gpu_power_knobs.validate({"gpu_psu_watts": "lots"}) == [
        "gpu_psu_watts must be a whole number of watts in 100..20000, got 'lots'"
    ]


# --- the testbed's simulated nvidia-smi for N cards ---


@pytest.mark.parametrize("gpus, links", [(4, ""), (4, "0-1=NV4,2-3=NV4"), (8, "")])
def test_the_simulated_topology_for_n_cards_reads_as_the_real_one(tmp_path, gpus, links):
    from rigforge.testbed import RigSpec, aptrepo

    script = tmp_path / "nvidia-smi"
    script.write_text(aptrepo.stub_script("nvidia-smi", DRIVER_VERSION=aptrepo.DRIVER_VERSION, FLAVOR="open"))
    (tmp_path / "etc/rigforge-sim").mkdir(parents=True)
    (tmp_path / "etc/rigforge-sim/gpus.json").write_text(json.dumps(RigSpec(gpus=gpus, links=links).gpus_json("t")))
    (tmp_path / "sys/module/nvidia").mkdir(parents=True)
    (tmp_path / "sys/module/nvidia/version").write_text(aptrepo.DRIVER_VERSION + "\n")
    env = {"RIGFORGE_SIM_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    lines = []
    for section, args in (("-m", ["-m"]), ("-p2p r", ["-p2p", "r"])):
        out = subprocess.run([sys.executable, str(script), "topo", *args], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout
        lines += [f"--- topo {section}", *out.stdout.splitlines()]
    topology = parse_topology(lines)
    pairs = [f"{a}-{b}" for a in range(gpus) for b in range(gpus) if a < b]
    named = dict(pair.split("=") for pair in links.split(",") if pair)
    assert topology["links"] == {pair: named.get(pair, "PHB") for pair in pairs}
    assert topology["p2p_read"] == {pair: "OK" if pair in named else "CNS" for pair in pairs}


def test_the_metrics_collector_declares_every_cards_cap():
    from rigforge.model.render import render_gpu_metrics
    from rigforge.model.schema import power_caps

    script = render_gpu_metrics(power_caps(4, Settings()), "vllm-qwen-27b-multi-fast", IMAGE)
    for i in range(4):
        assert f'rigforge_gpu_declared_cap_watts{{gpu="{i}"}} 230\n' in script
        assert f'$1 == "gpu{i}"' in script  # its set-backs counted too
    assert 'gpu="4"' not in script
