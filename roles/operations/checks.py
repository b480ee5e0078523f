"""Checks that stop one host with one clear message, before anything on it changes: `fail_command` logs it and
returns False, so pyinfra drops that host and carries on (raising while operations are prepared would abort all).
"""

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, Host, State, operation
from pyinfra.context import ctx_host

from rigforge.model.hardware import Needs, format_problems, gpu_count, gpu_problems
from rigforge.model.knobs.gpu_power import GpuPower
from rigforge.model.schema import Settings
from rigforge.observe.facts.nvidia import NvidiaGpus, NvidiaPciGpus, NvidiaTopology
from roles.operations.shown import Commands, unchanged


def _fail(state: State, host: Host, message: str) -> bool:
    """Log `message` in red (when there is one) and fail the host (a FunctionCommand's callback: pyinfra passes
    state and host to callbacks whose arguments use those names)."""
    if message:
        host.log_styled(message, fg="red", log_func=logger.error)
    return False


def fail_command(message: str) -> FunctionCommand:
    """A command that fails the current host with `message` when executed."""
    return FunctionCommand(_fail, (message,), {})


@operation()
def gpus_fit(needs: Needs, caps: dict[int, int], power: GpuPower, settings: Settings) -> Commands:
    """Fail this host unless nvidia-smi's GPUs (read when this executes) fit ``needs`` and ``caps`` covers them all.

    + needs: what the variant needs of a host (``rigforge.model.hardware.Needs``)
    + caps: the power unit's caps, ``{gpu index: watts}``
    + power: the GPU power knobs, the caps each card's range must hold (``rigforge.model.knobs.gpu_power.GpuPower``)
    + settings: the rig's settings, whose KV cache dtype and memory share may make a 20 GB card fit

    **Example:**

    .. code:: python

        from roles.operations.checks import gpus_fit
        gpus_fit(
            name="Check the GPUs now that the driver answers (2x 24000 MiB)",
            needs=needs,  # rigforge.model.hardware.Needs of the rig's variant
            caps={0: 230, 1: 230},
            power=plan.knobs.gpu_power,
            settings=plan.settings,
        )
    """
    gpus = host.get_fact(NvidiaGpus)
    if unchanged(not gpus and not state.is_executing, "GPUs are checked when this runs, once the driver answers"):
        return
    pci = host.get_fact(NvidiaPciGpus)  # a card on the bus nvidia-smi does not list is named (hardware.py)
    topology = host.get_fact(NvidiaTopology) if needs.nvlink else None  # the recipe's requires_nvlink
    problems = gpu_problems(gpus, needs, power, settings, pci, topology)
    if not gpus:
        problems.append(
            "nvidia-smi shows no GPU although the driver role finished; check `nvidia-smi` and `dmesg` on the rig."
        )
    present = sorted(int(gpu["index"]) for gpu in gpus)
    if gpus and present != sorted(caps) and len(caps) != gpu_count(gpus, pci):
        problems.append(
            f"the power unit would cap GPU(s) {sorted(caps)} but nvidia-smi shows GPU(s) {present}; re-run so "
            "the plan counts the GPUs again (and remove gpu_power_limits entries for absent GPUs)."
        )
    vram = "/".join(map(str, sorted({gpu.get("memory_total") for gpu in gpus})))
    if unchanged(not problems, f"{len(gpus)} GPU(s) with {vram} MiB fit {needs.variant}; caps in range"):
        return
    message = format_problems(host.name, problems, what="GPU check failed", changed=changed_by_this_run())
    if not state.is_executing:
        host.log_styled(message, fg="yellow", log_func=logger.warning)
    yield fail_command(message)


def changed_by_this_run() -> list[str]:
    """The names of this host's operations that ran and changed something so far in this run."""
    me, out = ctx_host.get(), []
    for op_hash in state.get_op_order():
        meta = getattr(state.ops[me].get(op_hash), "operation_meta", None)
        if meta is not None and meta.is_complete() and meta.did_change():
            out.append(" | ".join(sorted(state.get_op_meta(op_hash).names)) or op_hash)
    return out


def refuse_now(name: str, message: str) -> None:
    """Refuse this host while its operations are prepared: print `message` now (so `pyinfra --dry` shows it),
    count the host as failed (so the run exits 1) and queue the operation that stops it when the run executes
    (`refuse`, named `name`)."""
    host.log_styled(message, fg="red", log_func=logger.error)
    state.failed_hosts.add(ctx_host.get())  # the host itself, not pyinfra's context proxy
    refuse(name=name)


@operation(is_idempotent=False)
def refuse() -> Commands:
    """Fail this host, without a word (``refuse_now`` printed why; no arguments).

    **Example:**

    .. code:: python

        from roles.operations import checks
        checks.refuse(name="Refuse the rig")  # once why was said; refuse_now says it, then refuses
    """
    yield fail_command("")
