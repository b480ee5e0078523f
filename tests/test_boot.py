"""Boot order (rigforge/observe/boot.py): what ran at this boot, parsed from BootCaps' output, and the one verdict
"caps set last at this boot" that status and verify show. No host: the rig's answers are given.

The captured output in tests/fixtures/boot/ is BootCaps' own command run on a booted testbed rig (systemd 257,
Debian 13) after `rigforge testbed reboot`, with the recipe repo's nvidia-power-cap.service, a home-made unit
After=multi-user.target, a unit running a script and a @reboot cron job all setting 250 W: after-reboot.txt with
rigforge's units as rendered, old-after-ordering-cycle.txt with the old After= ordering put back by a drop-in.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rigforge.layout import HOLD_TIMER, POWER_UNIT, SETTLE_UNIT
from rigforge.model import fleet
from rigforge.observe import boot, drift, hosts
from rigforge.observe.facts import probe
from rigforge.observe.facts.nvidia import BootCaps

FIXTURES = Path(__file__).parent / "fixtures" / "boot"
WRITERS = {
    "nvidia-power-cap.service": {
        "kind": "unit",
        "path": "/etc/systemd/system/nvidia-power-cap.service",
        "watts": [250],
        "script": None,
    },
    "homemade-cap.service": {
        "kind": "unit",
        "path": "/etc/systemd/system/homemade-cap.service",
        "watts": [250],
        "script": None,
    },
    "@reboot in /etc/cron.d/gpu-cap": {
        "kind": "cron",
        "path": "/etc/cron.d/gpu-cap",
        "watts": [250],
        "script": "/usr/local/bin/cron-cap.sh",
        "command": "/usr/local/bin/cron-cap.sh",
    },
}


AT = "started at 12:00:09"


def unit(active="active", sub="exited", result="success", start=5_000_000, exit_=5_100_000, load="loaded"):
    return {
        "LoadState": load,
        "ActiveState": active,
        "SubState": sub,
        "Result": result,
        "ExecMainStatus": "0",
        "InactiveExitTimestampMonotonic": str(start),
        "ExecMainStartTimestampMonotonic": str(start),
        "ExecMainExitTimestampMonotonic": str(exit_),
    }


def seen(**changes) -> dict:
    """A clean boot: rigforge's unit early, two writers after it, the settle stage corrected both GPUs once."""
    base = {
        "boot_id": "b1",
        "system": "running",
        "units": {
            POWER_UNIT: unit(start=4_000_000, exit_=4_200_000),
            SETTLE_UNIT: unit(start=4_300_000, exit_=70_000_000),
            "nvidia-power-cap.service": unit(start=4_250_000, exit_=4_400_000),
            "homemade-cap.service": unit(active="inactive", sub="dead", start=9_000_000, exit_=9_100_000),
        },
        "cycles": [],
        "settle": [
            f"rigforge: GPU0 power limit 250 W (changed at 12:00:09 by the unit homemade-cap.service, {AT}); set back "
            "to 230 W",
            f"rigforge: GPU1 power limit 250 W (changed at 12:00:09 by the unit homemade-cap.service, {AT}); set back "
            "to 230 W",
            "rigforge: caps settled after a 60 s watch (2 correction(s))",
        ],
        "cron": ["(root) CMD (/usr/local/bin/cron-cap.sh)"],
        "caps": {0: 230.0, 1: 230.0},
    }
    return base | changes


def ctx(manage=True, writers=None, **data):
    plan, problems = fleet.plan_for("rig1", {"rigforge_variant": "dual", **data}, deployable=False)
    assert plan, problems
    return SimpleNamespace(
        manage=manage, plan=plan, settings=plan.settings, cap_units=WRITERS if writers is None else writers
    )


def test_a_clean_boot_passes_naming_every_writer_that_ran_and_the_corrections():
    status, detail = boot.boot_caps(seen(), ctx())
    assert status == "pass", detail
    assert detail == (
        "230 W, set last at this boot (after nvidia-power-cap.service set 250 W, homemade-cap.service set 250 W, "
        "@reboot in /etc/cron.d/gpu-cap set 250 W; 2 corrections by the settle stage, the last GPU1 250 W, changed at "
        f"12:00:09 by the unit homemade-cap.service, {AT})"
    )
    assert boot.summary(seen(), ctx()) == detail.removeprefix("230 W, ")


def test_without_other_writers_it_says_so():
    quiet = seen(settle=["rigforge: caps settled after a 60 s watch (0 correction(s))"], cron=[])
    status, detail = boot.boot_caps(quiet, ctx(writers={}))
    assert (status, detail) == (
        "pass",
        "230 W, set last at this boot (after no other writer ran; 0 corrections by the settle stage)",
    )


def test_an_ordering_cycle_in_the_journal_fails_even_with_the_caps_right():
    cycle = "rigforge-gpu-power.service: Job rigforge-gpu-power.service/start deleted to break ordering cycle"
    status, detail = boot.boot_caps(seen(cycles=[cycle, "another line"]), ctx())
    assert status == "fail" and f"ordering cycle: {cycle!r} (+1 more)" in detail


def test_a_power_unit_whose_start_job_was_deleted_did_not_run():
    """The old failure: the unit file promised After= ordering, systemd deleted the job, the caps stayed 250 W."""
    units = seen()["units"] | {POWER_UNIT: unit(active="inactive", sub="dead", result="success", start=0, exit_=0)}
    status, detail = boot.boot_caps(seen(units=units, caps={0: 250.0, 1: 250.0}), ctx())
    assert status == "fail"
    assert f"{POWER_UNIT} did not run at this boot (ActiveState=inactive, Result=success" in detail
    assert "GPU0 at 250 W, target 230 W" in detail
    assert boot.summary(seen(units=units), ctx()).startswith(f"NOT set last at this boot: {POWER_UNIT} did not run")


def test_a_missing_or_failed_settle_stage_fails():
    units = seen()["units"]
    missing = units | {SETTLE_UNIT: {"LoadState": "not-found", "ActiveState": "inactive"}}
    assert boot.boot_caps(seen(units=missing), ctx()) == ("fail", f"{SETTLE_UNIT} is not installed (run the deploy)")
    failed = units | {SETTLE_UNIT: unit(active="failed", sub="failed", result="exit-code")}
    lines = [
        f"rigforge: GPU1 power limit 250 W (changed at 12:00:09 by the unit x.service, {AT}); setting 230 W failed"
    ]
    status, detail = boot.boot_caps(seen(units=failed, settle=lines), ctx())
    assert status == "fail" and "failed at this boot (Result=exit-code" in detail
    assert "GPU1 power limit 250 W (changed at 12:00:09 by the unit x.service, started" in detail


def test_a_writer_after_the_settle_window_is_named():
    units = seen()["units"] | {"homemade-cap.service": unit(start=80_000_000, exit_=80_100_000)}
    status, detail = boot.boot_caps(seen(units=units, caps={0: 250.0, 1: 230.0}), ctx())
    assert status == "fail"
    assert detail == (
        "GPU0 at 250 W, target 230 W: changed after the settle stage's window by homemade-cap.service (the hold sets "
        "it back within 15 s and names the writer in the journal)"
    )


def test_a_writer_rigforge_does_not_know_is_said_so():
    status, detail = boot.boot_caps(seen(caps={0: 230.0, 1: 300.0}), ctx())
    assert (
        status == "fail"
        and "GPU1 at 300 W, target 230 W: changed after the settle stage's window by a writer "
        "rigforge did not find (the hold sets it back"
        in detail
    )


def test_while_the_settle_stage_watches_right_caps_pass_and_wrong_ones_fail():
    units = seen()["units"] | {SETTLE_UNIT: unit(active="active", sub="running", exit_=0)}
    status, detail = boot.boot_caps(seen(units=units, settle=[]), ctx())
    assert status == "pass" and detail.endswith(
        "0 corrections by the settle stage; the settle stage is still watching)"
    )
    status, detail = boot.boot_caps(seen(units=units, caps={0: 250.0, 1: 230.0}), ctx())
    assert status == "fail" and detail == "GPU0 at 250 W, target 230 W (the settle stage is still watching)"


def test_a_cron_writer_counts_as_ran_only_when_cron_logged_it():
    status, detail = boot.boot_caps(seen(cron=[]), ctx())
    assert status == "pass" and "@reboot" not in detail


def test_unmanaged_hosts_name_the_writers_found_and_drift_skips_the_check():
    assert boot.summary({}, ctx(manage=False)) == (
        "other cap writers: nvidia-power-cap.service (250 W), homemade-cap.service (250 W), @reboot in "
        "/etc/cron.d/gpu-cap (250 W); what ran not read (services not managed)"
    )
    assert boot.summary({}, ctx(manage=False, writers={})) == ""
    rig = hosts.RigContext(name="rig1", data=fleet.host_data({"rigforge_manage_services": False}))
    check = drift.caps_set_last(None, rig)
    assert (check.name, check.status, check.detail) == ("caps set last at this boot", drift.SKIP, drift.SKIPPED)


def test_drift_asks_the_probe_for_the_boot_fact_with_the_writers_units():
    plan, _ = fleet.plan_for("rig1", {"rigforge_variant": "dual"}, deployable=False)
    rig = hosts.RigContext(
        name="rig1",
        data=fleet.host_data({"rigforge_manage_services": True}),
        plan=plan,
        layout=plan.layout,
        variant_name="dual",
        cap_units=WRITERS,
    )
    asked = {probe.fact_key(c, k) for c, k in hosts.requests(rig, {"id": "debian", "version_id": "13"})}
    units = {"units": "nvidia-power-cap.service homemade-cap.service"}  # cron jobs have no unit to ask about
    assert probe.fact_key(BootCaps, units) in asked


def test_the_boot_fact_parses_its_sections():
    lines = [
        "boot_id=9c1d",
        "system=running",
        f"--- unit {POWER_UNIT}",
        "LoadState=loaded",
        "ActiveState=active",
        "Result=success",
        "ExecMainStartTimestampMonotonic=4000000",
        "--- unit nvidia-power-cap.service",
        "LoadState=not-found",
        "--- cycles",
        "--- settle",
        "rigforge: caps settled after a 60 s watch (0 correction(s))",
        "--- cron",
        "(root) CMD (/usr/local/bin/cron-cap.sh)",
        "--- caps",
        "0, 230.00",
        "1, [N/A]",
    ]
    got = BootCaps().process(lines)
    assert got["boot_id"] == "9c1d" and got["system"] == "running"
    assert got["units"][POWER_UNIT]["ExecMainStartTimestampMonotonic"] == "4000000"
    assert got["units"]["nvidia-power-cap.service"] == {"LoadState": "not-found"}
    assert got["cycles"] == [] and got["settle"] == ["rigforge: caps settled after a 60 s watch (0 correction(s))"]
    assert got["cron"] == ["(root) CMD (/usr/local/bin/cron-cap.sh)"] and got["caps"] == {0: 230.0}
    assert BootCaps().default() == boot.parse_boot([])


def test_a_chroot_answers_nothing_and_that_is_not_a_pass():
    """No systemd (the chroot testbed): systemctl and journalctl print nothing."""
    nothing = boot.parse_boot(["boot_id=x", "system=", *(f"--- {s}" for s in ("cycles", "settle", "cron", "caps"))])
    status, detail = boot.boot_caps(nothing, ctx())
    assert status == "fail" and f"{POWER_UNIT} is not installed" in detail and "no GPU" in detail


@pytest.mark.skipif(not (FIXTURES / "after-reboot.txt").exists(), reason="no capture")
def test_a_real_capture_after_a_reboot_with_four_writers_passes():
    got = BootCaps().process((FIXTURES / "after-reboot.txt").read_text().splitlines())
    assert got["units"][POWER_UNIT]["Result"] == "success" and got["cycles"] == []
    writers = {
        **WRITERS,
        "gpu-setup.service": {"kind": "unit", "watts": [250], "script": "/usr/local/bin/gpu-setup.sh"},
    }
    status, detail = boot.boot_caps(got, ctx(writers=writers))
    assert status == "pass", detail


def test_a_real_capture_of_the_old_after_ordering_fails_although_the_unit_file_promised_it():
    """tests/fixtures/boot/old-after-ordering-cycle.txt: the same rig and writers, with rigforge's old ordering put
    back by a drop-in (rigforge-gpu-power.service After= homemade-cap.service, which is After=multi-user.target).
    systemd deleted the start jobs to break the cycle (in a container the message never reaches the journal: it is
    logged before journald runs, so the units' results are what shows it); the caps stayed at 250 W."""
    got = BootCaps().process((FIXTURES / "old-after-ordering-cycle.txt").read_text().splitlines())
    assert got["units"][POWER_UNIT]["ExecMainStartTimestampMonotonic"] == "0" and got["caps"] == {0: 250.0, 1: 250.0}
    status, detail = boot.boot_caps(got, ctx())
    assert status == "fail"
    assert f"{POWER_UNIT} did not run at this boot (ActiveState=inactive, Result=success" in detail
    assert "GPU0 at 250 W, target 230 W, GPU1 at 250 W, target 230 W" in detail
    assert boot.summary(got, ctx()).startswith(f"NOT set last at this boot: {POWER_UNIT} did not run at this boot")


def test_the_settle_stage_is_in_the_plans_files_and_the_drift_check_files_as_rendered():
    plan = ctx().plan
    managed = hosts.managed_files(plan)
    assert managed[f"/etc/systemd/system/{SETTLE_UNIT}"] == (plan.files[SETTLE_UNIT], "644")
    assert managed["/usr/local/lib/rigforge/rigforge-gpu-settle"] == (plan.files["rigforge-gpu-settle"], "755")
    assert managed[f"/etc/systemd/system/{POWER_UNIT}"] == (plan.files[POWER_UNIT], "644")


CRON_LINE = (
    'rigforge: GPU0 power limit 250 W (changed between 12:03:00 and 12:03:15 by the cron job "@reboot sleep 40; '
    'nvidia-smi -pl 250" in /var/spool/cron/crontabs/root, run by cron at 12:02:20); set back to 230 W'
)


def test_the_holds_set_backs_after_the_settle_window_are_counted_and_the_last_writer_named():
    timer = {"LoadState": "loaded", "ActiveState": "active", "SubState": "waiting"}
    units = seen()["units"] | {HOLD_TIMER: timer}
    status, detail = boot.boot_caps(seen(units=units, hold=[CRON_LINE]), ctx())
    assert status == "pass", detail
    assert detail.endswith(
        "; held since: 1 set-back by the hold, the last GPU0 250 W, changed between 12:03:00 and 12:03:15 by the cron "
        'job "@reboot sleep 40; nvidia-smi -pl 250" in /var/spool/cron/crontabs/root, run by cron at 12:02:20'
    )
    status, detail = boot.boot_caps(seen(units=units), ctx())
    assert status == "pass" and detail.endswith(f"; held since by {HOLD_TIMER} (every 15 s), nothing set back")


def test_a_hold_timer_not_running_fails_unless_the_hold_is_turned_off():
    stopped = seen()["units"] | {HOLD_TIMER: {"LoadState": "loaded", "ActiveState": "inactive"}}
    status, detail = boot.boot_caps(seen(units=stopped), ctx())
    assert (status, detail) == ("fail", f"{HOLD_TIMER} is inactive: caps are not held (re-run the deploy)")
    missing = seen()["units"] | {HOLD_TIMER: {"LoadState": "not-found", "ActiveState": "inactive"}}
    assert boot.boot_caps(seen(units=missing), ctx())[1] == f"{HOLD_TIMER} is not installed (run the deploy)"
    off = ctx(gpu_power_hold=False)
    status, detail = boot.boot_caps(seen(units=stopped), off)
    assert status == "pass" and "held since" not in detail
    status, detail = boot.boot_caps(seen(units=stopped, caps={0: 250.0, 1: 230.0}), off)
    assert status == "fail" and detail.endswith(
        "by a writer rigforge did not find (gpu_power_hold is false: nothing sets it back until the next deploy or "
        "boot)"
    )


def test_a_set_back_the_hold_could_not_make_fails():
    failed = CRON_LINE.replace("set back to 230 W", "setting 230 W failed")
    status, detail = boot.boot_caps(seen(hold=[failed]), ctx())
    assert status == "fail" and detail.startswith(f"{HOLD_TIMER}: GPU0 power limit 250 W (changed between 12:03:00")


def test_a_unit_started_by_a_timer_is_named_with_its_timer():
    writers = {"recap.service": {"kind": "unit", "watts": [250], "script": None, "timer": "recap.timer"}}
    units = seen()["units"] | {"recap.service": unit(start=80_000_000, exit_=80_100_000)}
    status, detail = boot.boot_caps(seen(units=units, caps={0: 250.0, 1: 230.0}), ctx(writers=writers))
    assert status == "fail" and "by recap.service (started by recap.timer) (the hold sets it back" in detail
    assert boot.summary({}, ctx(manage=False, writers=writers)).startswith(
        "other cap writers: recap.service (started by recap.timer) (250 W)"
    )
