"""Long steps seen at pyinfra's default verbosity (no -v needed): downloads, checkouts, package installs."""

from collections.abc import Generator

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, Host, State, StringCommand
from pyinfra.api.arguments import ConnectorArguments
from pyinfra.api.command import PyinfraCommand
from pyinfra.connectors.util import CommandOutput

# what an @operation yields: shell text, or one of pyinfra's commands (pyinfra's operations/util: `yield from`)
Commands = Generator[str | PyinfraCommand, None, None]


class ShownCommand(StringCommand):
    """A shell command whose output is printed as it arrives, at any verbosity."""

    def execute(self, state: State, host: Host, connector_arguments: ConnectorArguments) -> tuple[bool, CommandOutput]:
        """Run the command as StringCommand does, its output printed as it arrives."""
        connector_arguments.update(self.connector_arguments)
        return host.run_shell_command(self, print_output=True, print_input=state.print_input, **connector_arguments)


def _log(state: State, host: Host, message: str) -> bool:
    """Log `message` on the host's line (a FunctionCommand's callback: pyinfra passes state and host)."""
    host.log(message)
    return True


def say(message: str) -> FunctionCommand:
    """A command that logs `message` on the host's line when it executes."""
    return FunctionCommand(_log, (message,), {})


def unchanged(condition: object, message: str) -> bool:
    """`condition`, telling pyinfra the operation has nothing to do (`host.noop(message)`) when it holds."""
    if condition:
        host.noop(message)
    return bool(condition)


def warn(message: str) -> None:
    """Say `message` in yellow on the host's line at any verbosity, also while pyinfra prepares."""
    host.log_styled(f"{host.name}: {message}", fg="yellow", log_func=logger.warning)


def repairing(message: str) -> None:
    """Warn what an interrupted run left and how it is repaired, when the repair executes."""
    if state.is_executing:
        warn(message)
