"""The check "boot order has no cycle" (rigforge/observe/facts/cycles.py): systemd's lines about ordering cycles turned
into cycles through rigforge's units, named with their units. No host: the rig's answers are given.

tests/fixtures/cycles/ holds OrderingCycles' real output (systemd 257, testbed rigs converged with
deploy/dual_turbo.py) with /etc/systemd/system/user-thing.service (After=docker.service,
Before=rigforge-gpu-power.service, WantedBy=multi-user.target) enabled:
- verify-chroot-*.txt: a chroot rig (no journal for the boot); systemd starts the cycle from a different job on each
  run: two captures, each naming it from another unit; then no-cycle, with the user's unit removed;
- booted-after-reboot.txt: a booted rig after `rigforge testbed reboot`: rigforge-gpu-power.service did not start,
  and the journal has no line about the cycle (logged before journald runs in a container);
- booted-journal-after-start.txt: the same rig after `systemctl stop` of the cycle's units and `systemctl start
  multi-user.target`: now pid 1 logs the cycle, and the job it dropped, to the journal.
"""

from pathlib import Path

import pytest

from rigforge.model import fleet
from rigforge.observe import drift, hosts
from rigforge.observe.facts import cycles, probe
from rigforge.observe.facts.cycles import Cycle, OrderingCycles, judge, parse, parse_cycles

FIXTURES = Path(__file__).parent / "fixtures" / "cycles"
POWER, SETTLE, VLLM = "rigforge-gpu-power.service", "rigforge-gpu-settle.service", "rigforge-vllm@dual-turbo.service"
RING = f"ordering cycle: {POWER} -> docker.service -> user-thing.service -> {POWER} (each ordered before the next"
FIX = (
    "remove the After=/Before= that closes it: /etc/systemd/system/user-thing.service (After=docker.service, "
    "Before=rigforge-gpu-power.service)"
)


def fixture(name: str) -> dict:
    return OrderingCycles().process((FIXTURES / name).read_text().splitlines())


@pytest.mark.parametrize("name", ["verify-chroot-docker-first.txt", "verify-chroot-user-first.txt"])
def test_a_real_capture_names_the_cycle_in_start_order_from_rigforges_unit(name):
    found = fixture(name)
    assert found["analyzed"] and found["journal"] is None  # a chroot: no journal for this boot
    (cycle,) = found["verify"]  # in start order: docker before the user's unit before rigforge's caps, before docker
    assert cycle.key() == ("docker.service/start", "user-thing.service/start", f"{POWER}/start")
    assert ("/etc/systemd/system/user-thing.service", "Before", [POWER]) in found["order"]
    status, detail = judge(found)
    assert status == "fail"
    assert detail == (
        f"{RING}; systemd-analyze verify), at boot systemd breaks it by dropping one of these start jobs (which one "
        f"can change each boot); {FIX}"
    )


def test_the_two_captures_are_one_cycle_logged_from_two_units():
    first, second = (
        fixture(n)["verify"][0] for n in ("verify-chroot-docker-first.txt", "verify-chroot-user-first.txt")
    )
    assert first.jobs != second.jobs and first.key() == second.key()
    lines = (FIXTURES / "verify-chroot-docker-first.txt").read_text().splitlines()
    logged = parse_cycles(lines)  # the boot's transaction and the explicit units': three times, once unbroken
    assert len(logged) == 3 and [c.unbroken for c in logged] == [False, True, False]
    assert logged[0].dropped == f"{POWER}/start"


def test_a_real_capture_without_the_users_unit_passes():
    found = fixture("verify-chroot-no-cycle.txt")
    assert (
        found["verify"] == []
        and ("/etc/systemd/system/rigforge-gpu-power.service", "Before", ["docker.service"]) in found["order"]
    )
    assert judge(found) == (
        "pass",
        "no ordering cycle through rigforge's units (systemd-analyze verify default.target)",
    )


JOURNAL = [  # systemd 252-257's lines as `journalctl -b _PID=1 -o cat` shows them
    f"{POWER}: Found ordering cycle on user-thing.service/start",
    f"{POWER}: Found dependency on docker.service/start",
    f"{POWER}: Found dependency on {POWER}/start",
    f"{POWER}: Job user-thing.service/start deleted to break ordering cycle starting with {POWER}/start",
]


USER_ORDER = [
    "/etc/systemd/system/user-thing.service:After=docker.service",
    "/etc/systemd/system/user-thing.service:Before=rigforge-gpu-power.service",
    "/etc/systemd/system/rigforge-gpu-power.service:Before=docker.service",  # rigforge's own: never named
]


def test_the_journal_says_which_job_systemd_dropped_at_this_boot():
    lines = ["--- verify", *JOURNAL, "--- journal", *JOURNAL, "--- order", *USER_ORDER]
    status, detail = judge(parse(lines))
    assert status == "fail"
    assert detail == (
        f"{RING}; journalctl -b), systemd broke it at this boot by dropping user-thing.service/start; {FIX}"
    )


def test_a_cycle_the_journal_missed_is_found_by_verify_on_a_booted_rig():
    status, detail = judge(parse(["--- verify", *JOURNAL, "--- journal", "--- order"]))
    assert status == "fail" and "systemd-analyze verify), at boot systemd breaks it" in detail
    assert detail.endswith("closes it in docker.service or user-thing.service (systemctl cat UNIT)")  # none local
    passed = judge(parse(["--- verify", "--- journal"]))
    assert passed == (
        "pass",
        "no ordering cycle through rigforge's units (systemd-analyze verify default.target and this boot's journal)",
    )


def test_systemd_258s_one_line_and_pre_232s_lines_give_the_same_cycle():
    new = [
        f"docker.service: Found ordering cycle: {POWER}/start after user-thing.service/start after "
        "docker.service/start - after rigforge-gpu-power.service",
        f"docker.service: Job {POWER}/start deleted to break ordering cycle starting with docker.service/start",
    ]
    old = [  # no unit prefix, a kernel timestamp, the "Breaking" line before the "Job ... deleted" one
        f"[    1.756941] systemd[1]: Found ordering cycle on {POWER}/start",
        "[    1.756950] systemd[1]: Found dependency on user-thing.service/start",
        "[    1.756955] systemd[1]: Found dependency on docker.service/start",
        f"[    1.756977] systemd[1]: Breaking ordering cycle by deleting job {POWER}/start",
        f"[    1.756984] systemd[1]: Job {POWER}/start deleted to break ordering cycle starting with {POWER}/start",
    ]
    captured = fixture("verify-chroot-docker-first.txt")["verify"][0]
    for lines in (new, old):
        (cycle,) = parse_cycles(lines)
        assert cycle == Cycle(captured.jobs, f"{POWER}/start")


def test_cycles_without_a_unit_of_rigforges_are_not_rigforges_to_report():
    lines = [
        "--- verify",
        "systemd-timesyncd.service: Found ordering cycle on dbus.socket/start",
        "systemd-timesyncd.service: Found dependency on sysinit.target/start",
        "systemd-timesyncd.service: Found dependency on systemd-timesyncd.service/start",
        "systemd-timesyncd.service: Job dbus.socket/start deleted to break ordering cycle starting with "
        "systemd-timesyncd.service/start",
    ]
    assert len(parse_cycles(lines)) == 1
    assert parse(lines)["verify"] == [] and judge(parse(lines))[0] == "pass"


def test_a_drop_in_on_rigforges_unit_and_the_vllm_instance_are_named():
    lines = [
        "--- verify",
        f"{VLLM}: Found ordering cycle on late.service/start",
        f"{VLLM}: Found dependency on {VLLM}/start",
        f"{VLLM}: Unable to break cycle starting with {VLLM}/start",
        "--- order",
        "/etc/systemd/system/late.service:After=network-online.target",  # not about the cycle
        "/etc/systemd/system/rigforge-vllm@.service:After=docker.service",
        "/etc/systemd/system/rigforge-vllm@.service.d/late.conf:  After=late.service",  # the template's drop-in
        "/etc/systemd/system/late.service:Before=multi-user.target rigforge-vllm@dual-turbo.service",
    ]
    status, detail = judge(parse(lines))
    assert status == "fail" and detail.startswith(f"ordering cycle: {VLLM} -> late.service -> {VLLM} (")
    assert detail.endswith(
        "closes it: /etc/systemd/system/rigforge-vllm@.service.d/late.conf (After=late.service), "
        "/etc/systemd/system/late.service (Before=rigforge-vllm@dual-turbo.service)"
    )


def test_a_booted_rig_whose_journal_missed_the_cycle_at_boot():
    found = fixture("booted-after-reboot.txt")
    assert found["journal"] == []  # read, and nothing about the cycle in it
    status, detail = judge(found)
    assert status == "fail"
    assert detail == (
        f"{RING}; systemd-analyze verify), at boot systemd breaks it by dropping one of these start jobs (which one "
        f"can change each boot); {FIX}"
    )


def test_a_booted_rig_whose_journal_logged_it_names_the_job_systemd_dropped():
    found = fixture("booted-journal-after-start.txt")
    assert [c.dropped for c in found["journal"]] == [f"{POWER}/start"]
    assert found["verify"][0].dropped == "user-thing.service/start"  # verify's own transaction: not what ran
    status, detail = judge(found)
    assert status == "fail"
    assert detail == f"{RING}; journalctl -b), systemd broke it at this boot by dropping {POWER}/start; {FIX}"


def test_no_systemd_analyze_on_the_rig_is_a_skip_not_a_pass():
    assert judge(parse([])) == ("skip", "systemd-analyze is not on the rig: the boot order was not read")
    assert judge(OrderingCycles().default())[0] == "skip"
    assert judge(None)[0] == judge({})[0] == "skip"  # no answer at all


def test_the_command_verifies_the_boot_and_rigforges_units_and_reads_the_journal_only_where_it_is():
    command = OrderingCycles().command(**cycles.arguments(VLLM)).get_raw_value()
    assert f"systemd-analyze verify $man default.target {POWER} {SETTLE} {VLLM} 2>&1" in command
    assert "if journalctl -b -q -n 0 >/dev/null 2>&1; then echo '--- journal'" in command
    assert cycles.arguments(None) == {"units": f"{POWER} {SETTLE}"}


class Answers:
    """An Observed answering only from status's and verify's one batched probe (a dict keyed as the probe keys)."""

    def __init__(self, answers: dict):
        self.answers = answers

    def get_fact(self, cls, **kwargs):
        return self.answers[probe.fact_key(cls, kwargs)]


def test_status_and_verify_ask_for_it_in_their_probe_and_the_check_reads_that_answer():
    data = fleet.host_data({"rigforge_manage_services": False})
    ctx = hosts.RigContext(name="rig1", data=data, manifest={"unit": VLLM})
    asked = [
        (cls, kwargs)
        for cls, kwargs in hosts.requests(ctx, {"id": "debian", "version_id": "13"})
        if cls is OrderingCycles
    ]
    assert asked == [(OrderingCycles, {"units": f"{POWER} {SETTLE} {VLLM}"})]  # services not managed: asked too
    answer = {probe.fact_key(OrderingCycles, asked[0][1]): fixture("verify-chroot-user-first.txt")}
    check = drift.boot_order(Answers(answer), ctx)
    assert (check.name, check.status) == ("boot order has no cycle", drift.FAIL) and RING in check.detail


def test_the_deploy_never_reads_it():
    """Budget: cycle detection runs in status and verify, not in the deploy's probe (no role or deploy reads it)."""
    repo = Path(__file__).resolve().parents[1]
    sources = [*(repo / "roles").rglob("*.py"), *(repo / "deploy").rglob("*.py")]
    assert sources and not [p for p in sources if "OrderingCycles" in p.read_text() or "facts.cycles" in p.read_text()]
