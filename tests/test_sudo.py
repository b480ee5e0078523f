"""Sudo that asks for a password (issue 32 case 5): one line naming the SSH user and what is needed, asked with
`sudo -n` so nothing prompts (pyinfra's own prompt waits for a TTY, then fails)."""

from __future__ import annotations

from pyinfra.connectors.util import CommandOutput, OutputLine

from rigforge.observe.inventory import sudo_problem


class Data:
    """Host data as pyinfra gives it: .get() only, not subscriptable."""

    def __init__(self, data: dict):
        self.get = data.get


class FakeHost:
    def __init__(self, data: dict, ok: bool, stdout=(), stderr=()):
        self.name, self.data, self.ran = "rig3", Data(data), []
        lines = [OutputLine("stdout", line) for line in stdout] + [OutputLine("stderr", line) for line in stderr]
        self.answer = (ok, CommandOutput(lines))

    def run_shell_command(self, command, **kwargs):
        self.ran.append((str(command.get_raw_value()), kwargs))
        return self.answer


PASSWORD = ["SUDO-PASSWORD"]  # what the check prints for sudo's "a password is required"


def test_sudo_that_asks_for_a_password_is_one_line_naming_the_user():
    host = FakeHost({"_sudo": True}, True, ["ai", *PASSWORD])
    assert sudo_problem(host) == (
        "sudo asks ai for a password on rig3: rigforge needs passwordless sudo for ai (a sudoers line "
        "'ai ALL=(ALL) NOPASSWD:ALL') or the password in host data _sudo_password"
    )
    ((command, kwargs),) = host.ran
    assert "id -un; out=$(sudo -n true 2>&1) && echo SUDO-OK" in command and kwargs == {}  # nothing prompts


def test_no_problem_without_sudo_with_a_password_or_when_sudo_works():
    assert sudo_problem(FakeHost({}, True, PASSWORD)) is None
    assert sudo_problem(FakeHost({"_sudo": True, "_sudo_password": "pw"}, True, PASSWORD)) is None
    assert sudo_problem(FakeHost({"_sudo": True}, True, ["ai", "SUDO-OK"])) is None
    assert sudo_problem(FakeHost({"_sudo": True}, True, ["ai", "SUDO-OTHER"])) is None  # said by what runs next


def test_sudo_user_is_asked_for():
    host = FakeHost({"_sudo": True, "_sudo_user": "svc"}, True, PASSWORD)
    assert sudo_problem(host).startswith("sudo asks the SSH user for a password on rig3")
    assert "sudo -n -u svc true" in host.ran[0][0]
