"""Tier 2: the GPU checks that see the hardware, on pyinfra's @fake hosts, and `rigforge verify`'s VRAM check.

`gpus_fit` runs right after the driver role and reads nvidia-smi when it executes: a rig whose GPUs are only
visible once the driver is in (a fresh rig) is checked then, and fails before anything after it runs.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.operations import server
from test_gpu_metrics import stand_in_smi
from test_roles_host_ops import PREFLIGHT, executed, gpu_row, make_state, rig

from rigforge.model import fleet
from rigforge.model.catalog import load_catalog
from rigforge.model.hardware import gpu_count, gpu_problems, missing_cards, vram_problems
from rigforge.model.knobs.gpu_power import GpuPower
from rigforge.model.schema import Settings
from rigforge.observe import drift, hosts
from rigforge.observe.drift import vram as check_vram
from rigforge.observe.facts.nvidia import SMI_QUERY, NvidiaGpus
from rigforge.testbed import RigSpec
from roles.operations import checks

DATA = {"gpu_power_limit_w": 230, "gpu_power_limits": {}}
POWER, SETTINGS = GpuPower.of(DATA), Settings()  # the caps every card gets; no 20 GB override


def run(hosts: dict, caps=None, data=None, gpus_appear_at_execution=None):
    """gpus_fit then a changing operation. `gpus_appear_at_execution`: nvidia-smi answers only once executing,
    as on a fresh rig whose driver the same run installs."""
    state = make_state(hosts)

    def deploy():
        cards, power = caps or {0: 230, 1: 230}, GpuPower.of(data or DATA)
        checks.gpus_fit(name="GPU check", needs=PREFLIGHT, caps=cards, power=power, settings=SETTINGS)
        server.shell(name="Change something", commands=["touch /rigforge-was-here"])

    add_deploy(state, deploy)
    for name, rows in (gpus_appear_at_execution or {}).items():  # the driver role "installed" the driver
        state.inventory.get_host(f"@fake/{name}").connector.data["fake_responses"]["--query-gpu="] = rows or [
            gpu_row(0),
            gpu_row(1),
        ]
    state.set_stage(StateStage.Execute)
    try:
        run_ops(state)
    except PyinfraError as exc:
        assert "No hosts remaining" in str(exc)
    return state


def test_fresh_rig_is_checked_when_the_driver_answers(caplog):
    small = [gpu_row(0, mib=20480), gpu_row(1, mib=20480)]
    state = run({"small": rig(gpus=[]), "ok": rig(gpus=[])}, gpus_appear_at_execution={"small": small, "ok": None})
    assert {h.name for h in state.failed_hosts} == {"@fake/small"}
    assert "touch /rigforge-was-here" not in executed(state, "small")
    assert "touch /rigforge-was-here" in executed(state, "ok")
    text = caplog.text
    assert "GPU check failed on @fake/small" in text and "have 20480 MiB, less than the 23000 MiB" in text


@pytest.mark.parametrize(
    "gpus, caps, data, expect",
    [
        ([gpu_row(0)], {0: 230}, DATA, "needs 2 GPUs, nvidia-smi shows 1"),
        ([gpu_row(0), gpu_row(1)], {0: 230, 1: 230}, {**DATA, "gpu_power_limit_w": 400}, "power cap 400 W"),
        (
            [gpu_row(0)],
            {0: 230, 1: 230},
            DATA,
            "the power unit would cap GPU(s) [0, 1] but nvidia-smi shows GPU(s) [0]",
        ),
        ([gpu_row(i) for i in range(3)], {0: 230, 1: 230}, DATA, "shows GPU(s) [0, 1, 2]"),
        ([], {0: 230, 1: 230}, DATA, "nvidia-smi shows no GPU although the driver role finished"),
    ],
)
def test_unfit_gpus_fail_the_host_before_later_operations(caplog, gpus, caps, data, expect):
    state = run({"r": rig(gpus=gpus), "ok": rig()}, caps=caps, data=data)
    assert "@fake/r" in {h.name for h in state.failed_hosts}
    assert "touch /rigforge-was-here" not in executed(state, "r")
    assert expect in caplog.text


def test_fitting_gpus_are_a_no_op():
    state = run({"r": rig(gpus=[gpu_row(0, limit=230.0), gpu_row(1, limit=230.0)])})
    assert not state.failed_hosts and "touch /rigforge-was-here" in executed(state, "r")


def test_vram_rules():
    cards20 = [{"index": i, "name": "RTX 3080 20GB", "memory_total": 20480} for i in range(2)]
    assert "set serving_kv_cache_dtype: fp8_e5m2" in vram_problems(cards20, "dual-turbo", 23000, False, False)[0]
    assert vram_problems(cards20, "dual-turbo", 23000, False, True) == []
    assert "(DFlash) needs 24 GB cards" in vram_problems(cards20, "dual-dflash", 23500, True, True)[0]
    cards3090 = [{"index": i, "name": "RTX 3090", "memory_total": 24576} for i in range(2)]
    assert vram_problems(cards3090, "dual-dflash", 23500, True, False) == []


def test_verify_checks_vram_against_the_variant():
    cards20 = [{"index": i, "name": "RTX 3080 20GB", "memory_total": 20480} for i in range(2)]
    check = check_vram(cards20, load_catalog().variants["dual-dflash"], Settings())
    assert check.status == "fail" and "needs 24 GB cards" in check.detail
    override = Settings(kv_cache_dtype="fp8_e5m2", gpu_memory_utilization=0.82)
    assert check_vram(cards20, load_catalog().variants["dual-turbo"], override).status == "pass"


def test_a_refusal_after_a_change_lists_what_this_run_changed(caplog):
    """The run's own record: an operation that changed the host before the check is named; nothing is claimed
    unchanged."""
    state = make_state({"small": rig(gpus=[]), "ok": rig(gpus=[])})

    def deploy():
        server.shell(name="Install the driver (stand-in)", commands=["touch /driver"])
        checks.gpus_fit(name="GPU check", needs=PREFLIGHT, caps={0: 230, 1: 230}, power=POWER, settings=SETTINGS)

    add_deploy(state, deploy)
    small = state.inventory.get_host("@fake/small").connector.data["fake_responses"]
    small["--query-gpu="] = [gpu_row(0, mib=20480), gpu_row(1, mib=20480)]
    state.inventory.get_host("@fake/ok").connector.data["fake_responses"]["--query-gpu="] = [gpu_row(0), gpu_row(1)]
    state.set_stage(StateStage.Execute)
    run_ops(state)
    message = caplog.text[caplog.text.index("GPU check failed on @fake/small") :]
    assert "This run changed this host before the check (the rest of the deploy did not run):" in message
    assert "* Install the driver (stand-in)" in message and "Nothing was changed" not in message


# ---------------------------------------------------------------- a card off the bus (issue 47)

PCI_TWO = ["pci 0000:01:00.0 0x2204", "pci 0000:02:00.0 0x2204", "end"]  # NvidiaPciGpus' lines: both cards seated
OFF_BUS = (
    "nvidia-smi shows 1 GPU(s); the PCI bus shows 2: GPU 1 (PCI 0000:02:00.0, 10de:2204, GeForce RTX 3090) is on "
    "the bus but nvidia-smi does not list it (fallen off the bus?): check its power cables and seating, and the "
    "kernel's Xid lines (`journalctl -k | grep -i xid`)"
)


def smi_gpu(index: int, bus: str) -> dict:
    return {"index": index, "pci_bus_id": bus, "name": "NVIDIA GeForce RTX 3090", "memory_total": 24576}


def test_a_card_on_the_pci_bus_that_nvidia_smi_does_not_list_is_named_not_asked_for():
    one = [smi_gpu(0, "00000000:01:00.0")]
    pci = [("0000:01:00.0", "2204"), ("0000:02:00.0", "2204")]
    assert missing_cards(one, pci) == [(1, "0000:02:00.0", "2204")]  # GPU 1 in PCI bus order
    problems = gpu_problems(one, PREFLIGHT, POWER, SETTINGS, pci)
    assert problems == [OFF_BUS]  # not "add a GPU": the rig has two
    assert missing_cards([smi_gpu(0, "00000000:01:00.0")], pci[:1]) == []
    # one card, on the bus and listed
    assert "add 1 GPU(s)" in gpu_problems(one, PREFLIGHT, POWER, SETTINGS, pci[:1])[0]
    assert missing_cards([], pci) == []  # no driver yet: the PCI checks' business (pci_problems)
    assert gpu_count(one, pci) == 2 and gpu_count(one, None) == 1 and gpu_count([], []) is None


def test_the_deploys_gpu_check_names_the_card_off_the_bus(caplog):
    """The plan counted two cards (the PCI bus's count), nvidia-smi lists one: the card is named with its bus address,
    and neither "add a GPU" nor "re-run so the plan counts the GPUs again" is said."""
    off = rig(gpus=[gpu_row(0)], extra={"/sys/bus/pci/devices": PCI_TWO})
    state = run({"r": off, "ok": rig()})
    assert "@fake/r" in {h.name for h in state.failed_hosts} and "@fake/ok" not in {h.name for h in state.failed_hosts}
    assert OFF_BUS in caplog.text
    assert "add a GPU" not in caplog.text and "plan counts the GPUs again" not in caplog.text


class Answers:
    """An Observed stand-in: each fact class's answer."""

    def __init__(self, **answers):
        self.answers = answers

    def get_fact(self, cls, **kwargs):
        return self.answers.get(cls.__name__)


def test_status_and_verify_name_the_card_off_the_bus():
    plan, problems = fleet.plan_for("r", {"rigforge_variant": "dual"}, deployable=False, gpus=2)
    assert not problems
    ctx = hosts.RigContext(name="r", data=fleet.host_data({}), plan=plan, layout=plan.layout, variant_name="dual")
    one = [smi_gpu(0, "00000000:01:00.0") | {"power_limit": 230.0, "persistence_mode": True}]
    pci = [("0000:01:00.0", "2204"), ("0000:02:00.0", "2204")]
    visible = drift.gpu_checks(Answers(NvidiaGpus=one, NvidiaPciGpus=pci), ctx)[0]
    assert (visible.name, visible.status, visible.detail) == ("GPUs visible", drift.FAIL, OFF_BUS)
    fine = drift.gpu_checks(Answers(NvidiaGpus=one, NvidiaPciGpus=pci[:1]), ctx)[0]
    assert fine.status == drift.FAIL and fine.detail.endswith("; dual needs 2")


def test_the_testbeds_stand_in_loses_a_card_and_the_checks_name_it_by_its_bus_address(tmp_path):
    """The stand-in nvidia-smi with GPU1 lost (its state's "lost", as after Xid 79): NVML lists one card (bus 01),
    sysfs still lists both (the booted rigs' PCI tree is made from gpus.json), and the check names bus 02."""
    smi, sim = stand_in_smi(tmp_path)
    state = sim / "var/lib/rigforge-sim/state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"lost": [1]}))
    env = {**os.environ, "RIGFORGE_SIM_ROOT": str(sim)}
    query = SMI_QUERY.removeprefix("timeout 60 nvidia-smi ").split()
    run = subprocess.run([str(smi), *query], env=env, capture_output=True, text=True)
    assert run.returncode == 15  # "GPU has fallen off the bus"; the fact reads the rows it printed all the same
    gpus = NvidiaGpus().process(run.stdout.splitlines())
    assert [(g["index"], g["pci_bus_id"]) for g in gpus] == [(0, "00000000:01:00.0")]
    spec = json.loads((sim / "etc/rigforge-sim/gpus.json").read_text())
    pci = [(g["pci_bus_id"][4:].lower(), RigSpec().pci_device) for g in spec["gpus"]]  # as booted.py lays sysfs out
    assert gpu_problems(gpus, PREFLIGHT, POWER, SETTINGS, pci) == [OFF_BUS]
