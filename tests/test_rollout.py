"""`rigforge rollout`'s messages and its choice of lock, without rigs: the deploys, the measurements on the rig and the
previews are stand-ins; the lock files, the promotion and what is said are the real ones. The rollout on booted rigs:
tests/testbed/test_booted_rollout.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rigforge.cli import rollout
from rigforge.model.pins import load_lock

DIGEST_A, DIGEST_B = "sha256:" + "a1" * 32, "sha256:" + "b1" * 32
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
IMAGE_A, IMAGE_B = f"vllm/vllm-openai:v0.27.1@{DIGEST_A}", f"vllm/vllm-openai:v0.31.0@{DIGEST_B}"


def write_lock(path: Path, commit: str, image: str) -> Path:
    """A lock with every entry resolved: the recipe pin at `commit`, its engine at `image` (ref@digest)."""
    ref, _, digest = image.partition("@")
    data = {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:nightly-x", "digest": "sha256:" + "7a" * 32},
        "git": {"recipes": {"url": "file:///nowhere/recipes.git", "ref": commit[:8], "commit": commit}},
        "images": {"vllm-stable": {"ref": ref, "digest": digest, "cuda": "13.0"}},
        "hf": {},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_lock(path).check() == []
    return path


@pytest.fixture
def locks(tmp_path):
    """(the lock in use, at A; the candidate, at B)."""
    in_use = write_lock(tmp_path / "lock.yaml", COMMIT_A, IMAGE_A)
    return in_use, write_lock(tmp_path / "lock-B.yaml", COMMIT_B, IMAGE_B)


def test_a_loss_reads_as_slower_and_a_gain_as_faster():
    assert rollout.speed_change(12.1, 6.05) == "50% slower than 12.1"
    assert rollout.speed_change(12.1, 13.1) == "8% faster than 12.1"
    assert rollout.speed_change(12.1, 12.1) == "the same as 12.1"


class Rig:
    """Stand-ins for the canary's deploys and what is measured on it: each deploy recorded as (lock name, rest); a
    deploy at a lock in `failing` fails as a health gate does; tokens/s by lock name; verify's failed checks."""

    def __init__(self, monkeypatch, speed: dict, failing=(), failed_checks=()):
        self.deploys: list[tuple[str, str | None]] = []
        self.speed, self.failing, self.failed_checks = speed, failing, list(failed_checks)
        monkeypatch.setattr(rollout, "deploy", self.deploy)
        monkeypatch.setattr(rollout, "on_rig", self.on_rig)
        monkeypatch.setattr(rollout, "tps", lambda h, lock, n: self.speed[lock.name])
        images = {"lock.yaml": IMAGE_A, "lock-B.yaml": IMAGE_B}
        monkeypatch.setattr(rollout, "_plan", lambda h, lock: SimpleNamespace(locked_image=images[lock.name]))

    def deploy(self, inventory_path, rig, lock, rest=None):
        self.deploys.append((lock.name, rest))
        if lock.name in self.failing and rest == "drained":
            raise rollout.RolloutError(
                f"{rig}: the deploy at {lock} failed (exit 1):\n"
                "rigforge health gate: the server exited while starting (rigforge-vllm@vllm-dual.service restarts it)"
            )

    def on_rig(self, inventory_path, rig, lock, fn):
        if fn is rollout.verify.check_host:
            checks = [SimpleNamespace(name=name, status="fail", detail=detail) for name, detail in self.failed_checks]
            return checks, None
        return fn(SimpleNamespace(name=rig), None)


def canary_args(**kw):
    return SimpleNamespace(inventory="inv.py", bench_requests=5, max_loss=0.30, **kw)


BACK_AT_A = f"(recipes at {COMMIT_A[:12]}, image vllm/vllm-openai:v0.27.1@sha256:{'a1' * 6})"


def test_a_slow_canary_prints_its_loss_as_slower_and_says_where_it_went_back(monkeypatch, locks, capsys):
    old, new = locks
    rig = Rig(monkeypatch, speed={"lock.yaml": 12.1, "lock-B.yaml": 6.05})
    with pytest.raises(rollout.CanaryFailed) as failed:
        rollout.canary(canary_args(), SimpleNamespace(name="rig1"), old, new)
    said = capsys.readouterr().out
    assert "rollout: rig1: canary 6.0 tokens/s at lock-B.yaml: 50% slower than 12.1 (allowed: 30% slower)" in said
    assert "+50%" not in said
    assert f"rollout: rig1: canary did not hold: rolling it back to {old} {BACK_AT_A}" in said, said
    assert str(failed.value) == (
        "the canary rig1 did not hold: measured loss 50% > allowed 30% (12.1 -> 6.0 tokens/s); "
        f"it is back at {old} {BACK_AT_A}, nothing promoted"
    )
    assert rig.deploys == [("lock.yaml", "drained"), ("lock-B.yaml", "drained"), ("lock.yaml", None)]


def test_a_faster_canary_says_faster_and_rejoins_at_the_candidate(monkeypatch, locks, capsys):
    old, new = locks
    rig = Rig(monkeypatch, speed={"lock.yaml": 12.1, "lock-B.yaml": 13.1})
    rollout.canary(canary_args(), SimpleNamespace(name="rig1"), old, new)
    assert "canary 13.1 tokens/s at lock-B.yaml: 8% faster than 12.1 (allowed: 30% slower)" in capsys.readouterr().out
    assert rig.deploys[-1] == ("lock-B.yaml", None)


def test_a_crash_looping_canary_names_the_lock_image_and_commit_it_went_back_to(monkeypatch, locks, capsys):
    """The candidate's server exits while starting: the deploy's health gate fails fast; the rollout says the
    deploy failed (not verify), where the canary is back at, then the end of the deploy's output."""
    old, new = locks
    rig = Rig(monkeypatch, speed={"lock.yaml": 12.1}, failing=("lock-B.yaml",))
    with pytest.raises(rollout.CanaryFailed) as failed:
        rollout.canary(canary_args(), SimpleNamespace(name="rig1"), old, new)
    first, _, tail = str(failed.value).partition("\n")
    assert first == (
        f"the canary rig1 did not hold: rig1: the deploy at {new} failed (exit 1); it is back at {old} {BACK_AT_A}, "
        "nothing promoted"
    )
    assert tail.startswith("rigforge health gate: the server exited while starting")
    said = capsys.readouterr().out
    assert f"rollout: rig1: canary at lock-B.yaml: rig1: the deploy at {new} failed (exit 1):" in said
    assert "verify failed" not in said + str(failed.value)
    assert rig.deploys[-1] == ("lock.yaml", None)


def test_a_canary_failing_verify_names_the_check(monkeypatch, locks):
    old, new = locks
    Rig(monkeypatch, speed={"lock.yaml": 12.1}, failed_checks=[("unit active", "rigforge-vllm@vllm-dual: failed")])
    with pytest.raises(rollout.CanaryFailed) as failed:
        rollout.canary(canary_args(), SimpleNamespace(name="rig1"), old, new)
    assert str(failed.value) == (
        "the canary rig1 did not hold: verify failed (unit active: rigforge-vllm@vllm-dual: failed); "
        f"it is back at {old} {BACK_AT_A}, nothing promoted"
    )


def test_a_second_rollback_refuses_and_names_the_way_forward(locks):
    """Promote B, roll back to A, then --rollback again: refused, naming the lock rolled back from; `--to` it moves
    forward, after which --rollback goes back to A again."""
    old, new = locks
    a, b = old.read_text(), new.read_text()
    with pytest.raises(rollout.RolloutError, match=r"nothing to roll back to: no .*lock.yaml.previous \(no bump"):
        rollout.target(old, None, rollback=True)
    assert rollout.promote(old, new, rollback=False) == Path(f"{old}.previous")
    assert old.read_text() == b and Path(f"{old}.previous").read_text() == a

    back = rollout.target(old, None, rollback=True)
    assert back == Path(f"{old}.previous")
    assert rollout.promote(old, back, rollback=True) == Path(f"{old}.rolled-back")
    assert old.read_text() == a and Path(f"{old}.rolled-back").read_text() == b
    assert not Path(f"{old}.previous").exists()  # it is the lock in use now: nothing to go back to

    with pytest.raises(rollout.RolloutError) as refused:
        rollout.target(old, None, rollback=True)
    assert str(refused.value) == (
        f"nothing to roll back to: the last promotion was a rollback, and --rollback never moves forward; {old} "
        "holds what the rolled-back bump had replaced. To run the lock it rolled back from again (forward): "
        f"`rigforge rollout INVENTORY --to {old}.rolled-back`"
    )

    forward = rollout.target(old, Path(f"{old}.rolled-back"), rollback=False)
    rollout.promote(old, forward, rollback=False)
    assert old.read_text() == b and Path(f"{old}.previous").read_text() == a
    assert not Path(f"{old}.rolled-back").exists()
    assert rollout.target(old, None, rollback=True) == Path(f"{old}.previous")


def test_no_candidate_is_said_plainly(tmp_path, locks):
    old, _ = locks
    with pytest.raises(rollout.RolloutError, match=r"^no candidate lock: give --to FILE, or --rollback$"):
        rollout.target(old, None, rollback=False)
    with pytest.raises(rollout.RolloutError, match=r"^no candidate lock: .*/missing.yaml is not a file$"):
        rollout.target(old, tmp_path / "missing.yaml", rollback=False)


def image_at(lock: Path) -> str:
    """The image a rig runs at `lock` (its engine's, by digest)."""
    pins = load_lock(lock)
    return pins.pinned(pins.images["vllm-stable"].ref)


def fleet_of(monkeypatch, old: Path, names=("rig1", "rig2")) -> list[tuple[str, str]]:
    """Rigs at the lock `old`, without opening an inventory; the previews read the image from each lock, the canary
    holds; returns the deploys of the other rigs, (rig, lock file name) each."""
    rigs = [SimpleNamespace(name=n, groups=("rigs",), data={"rigforge_lock": str(old)}) for n in names]
    monkeypatch.setattr(rollout.inventory, "open_inventory", lambda path: SimpleNamespace(inventory=rigs))
    monkeypatch.setattr(
        rollout,
        "preview",
        lambda h, a, b: {"rig": h.name, "image": (image_at(a), image_at(b)), "flags": {}, "fetch": {}, "restart": []},
    )
    monkeypatch.setattr(rollout, "canary", lambda args, h, a, b: None)
    deploys = []
    monkeypatch.setattr(rollout, "deploy", lambda inv, rig, lock, rest=None: deploys.append((rig, lock.name)))
    return deploys


def run_args(**given) -> SimpleNamespace:
    """`rigforge rollout inv.py`'s arguments, their defaults but for `given`."""
    defaults = {"inventory": "inv.py", "to": None, "rollback": False, "dry": False, "canary": None, "max_loss": 0.3}
    return SimpleNamespace(**{**defaults, "bench_requests": 5, "promote_with_held": False, **given})


def test_a_rollout_and_its_rollback_say_where_the_fleet_goes(monkeypatch, locks, capsys):
    old, new = locks
    deploys = fleet_of(monkeypatch, old)
    assert rollout.run(run_args(to=new)) == 0
    said = capsys.readouterr().out
    at_b = f"(recipes at {COMMIT_B[:12]}, image vllm/vllm-openai:v0.31.0@sha256:{'b1' * 6})"
    assert f"rollout: promoted {new} to {old} {at_b}; the lock it replaced is kept as {old}.previous" in said, said
    assert deploys == [("rig2", "lock-B.yaml")]

    previous = Path(f"{old}.previous")
    assert rollout.run(run_args(rollback=True)) == 0
    said = capsys.readouterr().out
    assert f"rollout: rollback: from {old} {at_b} back to {previous} {BACK_AT_A}" in said, said
    assert (
        f"rollout: rolled back: {old} {BACK_AT_A} holds again what the last bump replaced; the lock rolled back from "
        f"is kept as {old}.rolled-back (a second --rollback refuses; `--to {old}.rolled-back` moves forward again)"
    ) in said, said

    assert rollout.run(run_args(rollback=True)) == 1
    out, err = capsys.readouterr()
    assert "nothing to roll back to: the last promotion was a rollback, and --rollback never moves forward" in err
    assert out == "" and load_lock(old).git["recipes"].commit == COMMIT_A


def test_to_and_rollback_together_are_refused(capsys):
    from rigforge.cli.main import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["rollout", "inv.py", "--to", "x.yaml", "--rollback"])
    assert exited.value.code == 2
    assert "--rollback: not allowed with argument --to" in capsys.readouterr().err


def test_a_rig_failing_its_deploy_stops_the_rollout_saying_who_runs_what(monkeypatch, locks, capsys):
    old, new = locks
    fleet_of(monkeypatch, old, names=("rig1", "rig2", "rig3"))
    deploys = []

    def deploy(inventory_path, rig, lock, rest=None):
        deploys.append(rig)
        if rig == "rig3":
            tail = "rigforge health gate: rolled back"
            raise rollout.RolloutError(f"rig3: the deploy at {lock} failed (exit 1):\n{tail}")

    monkeypatch.setattr(rollout, "deploy", deploy)
    assert rollout.run(run_args(to=new)) == 1
    err = capsys.readouterr().err
    assert err == (
        f"rigforge rollout: rig3: the deploy at {new} failed (exit 1); the rollout stopped: rig1, rig2 run {new}, the "
        f"lock in use is still {old}. `rigforge status inv.py` shows which rigs run the candidate; a deploy of the "
        "inventory (`pyinfra inv.py deploy/site.py`) puts every rig back at lock.yaml\n"
        "rigforge health gate: rolled back\n"
    )
    assert deploys == ["rig2", "rig3"] and load_lock(old).git["recipes"].commit == COMMIT_A
    assert not Path(f"{old}.previous").exists()
