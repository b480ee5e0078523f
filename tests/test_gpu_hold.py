"""The cap hold's pass (templates/rigforge-gpu-hold.j2), run on the controller against the testbed's stand-in
nvidia-smi: caps another writer changed are set back, each set-back is one line naming the writer rigforge finds
(a cron job of any schedule, a sudo'd nvidia-smi, a unit started by a timer, a udev rule) or saying it found none,
and is counted per GPU in the state file the GPU collector exports as rigforge_gpu_cap_setbacks_total.

journalctl and systemctl are stand-ins on PATH that answer from files (the journal's CRON and sudo lines, systemd's
start times); the unit dirs, cron tables and udev rules dirs are rendered into the script under tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from test_gpu_metrics import parse, pci_tree, run_collector, stand_in_smi, value

from rigforge.layout import GPU_METRICS_FILE
from rigforge.model.render import hold_script

JOURNALCTL = """#!/bin/sh
case "$*" in *_COMM=sudo*) cat "$FAKE/sudo.log" 2>/dev/null ;; *"-t CRON"*) cat "$FAKE/cron.log" 2>/dev/null ;; esac
"""
SYSTEMCTL = """#!/bin/sh
# show -p PROPERTY --value -- UNIT
f="$FAKE/show/$6.$3"
if [ -f "$f" ]; then cat "$f"; else echo 0; fi
"""
LINE = re.compile(
    r"^rigforge: GPU(\d) power limit (\d+) W \(changed (?:at|between) [0-9:]+(?: and [0-9:]+)? by (.*)\); "
    r"set back to (\d+) W$"
)


class Rig:
    """The stand-in nvidia-smi, fake journal and systemd, and the rendered pass, all under tmp_path."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.smi, self.sim = stand_in_smi(tmp_path)
        for d in ("units", "cron.d", "crontabs", "udev", "show", "bin"):
            (tmp_path / d).mkdir(exist_ok=True)
        for name, text in (("journalctl", JOURNALCTL), ("systemctl", SYSTEMCTL)):
            (tmp_path / "bin" / name).write_text(text)
            (tmp_path / "bin" / name).chmod(0o755)
        crons = (f"{tmp_path}/crontab", f"{tmp_path}/cron.d/*", f"{tmp_path}/crontabs/*")
        script = hold_script((str(tmp_path / "units"),), crons, (str(tmp_path / "udev"),))
        self.script = tmp_path / "rigforge-gpu-hold"
        self.script.write_text(script)
        self.script.chmod(0o755)
        self.state = tmp_path / "state" / "gpu-cap-setbacks"
        self.env = {
            **os.environ,
            "RIGFORGE_SIM_ROOT": str(self.sim),
            "FAKE": str(tmp_path),
            "PATH": f"{tmp_path / 'bin'}:{self.smi.parent}:{os.environ['PATH']}",
        }

    def set_cap(self, gpu: int, watts: int) -> None:
        argv = [str(self.smi), "-i", str(gpu), "-pl", str(watts)]
        subprocess.run(argv, env=self.env, check=True, capture_output=True)

    def caps(self) -> list[float]:
        state = json.loads((self.sim / "var/lib/rigforge-sim/state.json").read_text())
        return [state[str(i)]["power_limit"] for i in range(2)]

    def hold(self) -> subprocess.CompletedProcess:
        argv = [str(self.script), str(self.smi), str(self.state), "0:230", "1:230"]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)

    def counts(self) -> dict[str, int]:
        rows = (line.split() for line in self.state.read_text().splitlines())
        return {key: int(n) for key, n in rows if key.startswith("gpu")}


def journal(path: Path, *lines: str) -> None:
    now = int(time.time())
    path.write_text("".join(f"{now - 2}.5 rig1 {line}\n" for line in lines))


def test_changed_caps_are_set_back_counted_and_a_writer_not_found_is_said_so(tmp_path):
    rig = Rig(tmp_path)
    rig.set_cap(0, 230)
    rig.set_cap(1, 250)
    r = rig.hold()
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    assert LINE.match(line).groups() == ("1", "250", "a writer rigforge did not find", "230"), line
    assert rig.caps() == [230.0, 230.0] and rig.counts() == {"gpu1": 1}
    again = rig.hold()
    assert again.returncode == 0 and again.stdout == "" and rig.counts() == {"gpu1": 1}  # nothing to set back

    # the collector exports the count, 0 for a GPU never set back
    run_collector(
        tmp_path, rig.smi, pci_tree(tmp_path, {}), env={"RIGFORGE_SIM_ROOT": str(rig.sim)}, setbacks=rig.state
    )
    m = parse((tmp_path / "textfile" / GPU_METRICS_FILE).read_text())
    assert value(m, "rigforge_gpu_cap_setbacks_total", gpu="1") == 1
    assert value(m, "rigforge_gpu_cap_setbacks_total", gpu="0") == 0
    assert m["rigforge_gpu_cap_setbacks_total"]["type"] == "counter"


def test_the_late_reboot_cron_job_of_the_issue_is_named_once(tmp_path):
    """`@reboot sleep 40; nvidia-smi -pl 250` in root's crontab: named by its line and file. Its run is named once:
    a later change is not blamed on a run that started before the last pass."""
    rig = Rig(tmp_path)
    (tmp_path / "crontabs/root").write_text("# m h dom mon dow command\n@reboot sleep 40; nvidia-smi -pl 250\n")
    journal(tmp_path / "cron.log", "CRON[812]: (root) CMD (sleep 40; nvidia-smi -pl 250)")
    rig.set_cap(0, 250)
    rig.set_cap(1, 250)
    out = rig.hold().stdout.splitlines()
    job = f'the cron job "@reboot sleep 40; nvidia-smi -pl 250" in {tmp_path}/crontabs/root, run by cron at '
    assert [LINE.match(line)[1] for line in out] == ["0", "1"]
    assert all(LINE.match(line)[3].startswith(job) for line in out), out
    assert rig.counts() == {"gpu0": 1, "gpu1": 1}
    time.sleep(1.1)
    rig.set_cap(0, 240)
    (line,) = rig.hold().stdout.splitlines()
    assert LINE.match(line).groups() == ("0", "240", "a writer rigforge did not find", "230"), line
    assert rig.counts() == {"gpu0": 2, "gpu1": 1}


def test_a_cron_job_of_any_schedule_running_a_script_is_named(tmp_path):
    rig = Rig(tmp_path)
    (tmp_path / "caps.sh").write_text("#!/bin/sh\nnvidia-smi -i 1 -pl 260\n")
    (tmp_path / "cron.d/gpu").write_text(f"SHELL=/bin/sh\n*/5 * * * * root {tmp_path}/caps.sh >/dev/null\n")
    journal(tmp_path / "cron.log", f"CRON[9]: (root) CMD ({tmp_path}/caps.sh >/dev/null)")
    rig.set_cap(0, 230)
    rig.set_cap(1, 260)
    (line,) = rig.hold().stdout.splitlines()
    who = LINE.match(line)[3]
    job = f'the cron job "*/5 * * * * {tmp_path}/caps.sh >/dev/null" in {tmp_path}/cron.d/gpu, run by cron at '
    assert who.startswith(job), who


def test_a_sudoed_nvidia_smi_a_timers_unit_and_a_udev_rule_are_named(tmp_path):
    rig = Rig(tmp_path)
    rig.set_cap(0, 230)
    rig.set_cap(1, 300)
    journal(
        tmp_path / "sudo.log",
        "sudo[99]:    alice : TTY=pts/0 ; PWD=/home/alice ; USER=root ; COMMAND=/usr/bin/nvidia-smi -i 1 -pl 300",
    )
    (line,) = rig.hold().stdout.splitlines()
    assert LINE.match(line)[3] == "alice with sudo: /usr/bin/nvidia-smi -i 1 -pl 300", line
    (tmp_path / "sudo.log").unlink()

    (tmp_path / "recap.sh").write_text("#!/bin/sh\nnvidia-smi -pl 270\n")
    (tmp_path / "units/recap.service").write_text(f"[Service]\nExecStart=-{tmp_path}/recap.sh\n")
    up = float(Path("/proc/uptime").read_text().split()[0])
    (tmp_path / "show/recap.service.InactiveExitTimestampMonotonic").write_text(f"{int((up - 1) * 1e6)}\n")
    (tmp_path / "show/recap.service.TriggeredBy").write_text("recap.timer\n")
    rig.set_cap(1, 270)
    (line,) = rig.hold().stdout.splitlines()
    assert LINE.match(line)[3].startswith("the timer recap.timer (it starts recap.service), started at "), line
    (tmp_path / "units/recap.service").unlink()

    (tmp_path / "udev/90-gpu.rules").write_text('ACTION=="add", RUN+="/usr/bin/nvidia-smi -pl 280"\n')
    rig.set_cap(1, 280)
    (line,) = rig.hold().stdout.splitlines()
    who = LINE.match(line)[3]
    assert who == f"the udev rule in {tmp_path}/udev/90-gpu.rules (udev runs it when a GPU appears)", line
    assert rig.counts() == {"gpu1": 3} and rig.caps() == [230.0, 230.0]


def test_a_cap_that_cannot_be_set_fails_the_pass_and_is_not_counted(tmp_path):
    rig = Rig(tmp_path)
    rig.set_cap(0, 230)
    rig.set_cap(1, 250)
    r = subprocess.run(
        [str(rig.script), str(rig.smi), str(rig.state), "0:230", "1:9999"], env=rig.env, capture_output=True, text=True
    )
    assert r.returncode == 1
    assert r.stdout.startswith("rigforge: GPU1 power limit 250 W (changed ") and r.stdout.endswith(
        "; setting 9999 W failed\n"
    )
    assert rig.counts() == {}


RACING_SMI = """#!/bin/sh
# nvidia-smi, then (once, on the first -pl) another writer setting GPU1 to 250 W before anyone reads it back
"$REAL_SMI" "$@" || exit $?
case "$*" in *-pl*) [ -f "$FAKE/race" ] && rm "$FAKE/race" && "$REAL_SMI" -i 1 -pl 250 >/dev/null ;; esac
exit 0
"""


def test_a_writer_setting_its_cap_again_right_after_the_set_back_is_set_back_again_not_failed(tmp_path):
    """Another writer's `nvidia-smi -pl` landing between the pass's set and its read-back (a cron job's second card,
    at boot) is not a cap that cannot be set: the pass sets it again, says "set back" once, and succeeds."""
    rig = Rig(tmp_path)
    rig.set_cap(0, 230)
    rig.set_cap(1, 250)
    racing = tmp_path / "bin/racing-smi"
    racing.write_text(RACING_SMI)
    racing.chmod(0o755)
    (tmp_path / "race").touch()
    argv = [str(rig.script), str(racing), str(rig.state), "0:230", "1:230"]
    r = subprocess.run(argv, env={**rig.env, "REAL_SMI": str(rig.smi)}, capture_output=True, text=True, timeout=60)
    assert not (tmp_path / "race").exists(), "the other writer never ran"
    assert r.returncode == 0, r.stdout + r.stderr
    assert [LINE.match(line)[1] for line in r.stdout.splitlines()] == ["1"], r.stdout
    assert rig.caps() == [230.0, 230.0] and rig.counts() == {"gpu1": 1}


def test_a_card_off_the_bus_is_left_to_the_gpu_checks(tmp_path):
    """A card nvidia-smi cannot reach (the stand-in's "lost", as after Xid 79) is not this pass's to set: the others
    are held, the pass succeeds, nothing is counted for it ("GPUs visible" names it by its bus address)."""
    rig = Rig(tmp_path)
    rig.set_cap(0, 250)
    state = rig.sim / "var/lib/rigforge-sim/state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "lost": [1]}))
    r = rig.hold()
    assert r.returncode == 0, r.stdout + r.stderr
    assert [LINE.match(line)[1] for line in r.stdout.splitlines()] == ["0"]
    assert rig.counts() == {"gpu0": 1}
