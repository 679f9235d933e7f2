"""The process group of a pipeline run: its rendezvous, its backend and device, its transport
(:mod:`nobubble.pipeline.transport`), and a teardown that holds.

The backend (``dist_backend``): ``auto`` is NCCL on CUDA (one GPU per local rank, which NCCL
requires) and gloo on the CPU; ``gloo`` also runs CUDA tensors (messages through host memory), and
then local ranks may share GPUs (local rank i on GPU i mod the GPUs visible), which runs every
CUDA path of the pipeline on one GPU but NCCL's own. ``emulate_nccl=true`` runs gloo as NCCL would
(:mod:`nobubble.pipeline.emulated_nccl`) and is refused on NCCL itself.

Why the teardown needs care: in torch 2.13 the first optimizer a process builds imports
``torch._dynamo``, and when that import happens while a process group exists, it keeps about ten
references to the default group. ``destroy_process_group()`` then cannot free the backend: gloo's
worker and transport threads live on into interpreter shutdown, where their teardown races the
interpreter's and, now and then, ends a finished run in SIGABRT ("terminate called without an
active exception"). So :func:`open_process_group` imports ``torch._dynamo`` first, and
:func:`close_process_group` checks that nobody else still holds the group. If something does
(another library, a later torch), the process ends without interpreter teardown once its work is
done (:func:`exit_code`), so a finished job still exits with its code instead of crashing. The
same holds for the emulator's threads: one stuck in gloo after a failure ends with the process.

That close is graceful, and on NCCL ``destroy_process_group()`` waits for every operation posted.
After an error, a receive posted ahead may never complete (its peer failed, or waits for what
this rank will never send), and the close would wait for NCCL's watchdog (``group_timeout_s``).
So an error ends with :func:`abort_process_group` instead, which waits for nothing; the process
then ends without interpreter teardown, whatever the abort left running.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from nobubble.config import ConfigError, TrainConfig
from nobubble.device import resolve_device
from nobubble.layout import first_process
from nobubble.pipeline.emulated_nccl import EmulatedNccl
from nobubble.pipeline.transport import Transport, active, install

_OUTLIVED: list[str] = []  # what outlived close_process_group in this process, and how
_ABORTED: list[str] = []  # the backend of the group abort_process_group aborted, if it ran


def device_and_backend(cfg: TrainConfig) -> tuple[torch.device, str]:
    """This rank's device and the process-group backend for it (the module's docstring); a
    backend the device or ``emulate_nccl`` cannot run is refused with the fix."""
    device = resolve_device(cfg.device)
    backend = cfg.dist_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    check_backend(cfg, device, backend)
    if device.type != "cuda":
        return device, backend
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if backend == "nccl" and local >= count:
        raise ConfigError(
            f"NCCL needs a GPU of its own for every process, and local rank {local} has none "
            f"({count} visible): start at most {count} processes on this node, or set "
            "dist_backend=gloo to let processes share GPUs"
        )
    torch.cuda.set_device(local % count)
    return torch.device("cuda", local % count), backend


def check_backend(cfg: TrainConfig, device: torch.device, backend: str) -> None:
    """Refuse a backend the device cannot run, and the emulator on NCCL itself."""
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"dist_backend=nccl needs CUDA tensors and this run trains on {device.type}; set "
            "device=cuda, or dist_backend=auto (gloo on the CPU)"
        )
    if cfg.emulate_nccl and backend != "gloo":
        why = "dist_backend=nccl" if cfg.dist_backend == "nccl" else "device=cuda picks it"
        raise ConfigError(
            f"emulate_nccl=true runs gloo as NCCL would, and this run's backend is {backend} "
            f"({why}): set dist_backend=gloo to emulate it with this GPU's tensors (processes "
            "may then share a GPU), or drop emulate_nccl to run NCCL itself"
        )


def attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this torchrun attempt.

    After a restart (``--max-restarts``), torch 2.13's default env:// store hands the new workers
    the previous attempt's gloo addresses and the connection fails; a prefix per attempt avoids
    that. Under torchrun the agent hosts the store; under other launchers rank 0 does.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_hosts_it,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"nobubble/attempt_{attempt}/", store)


def open_process_group(
    backend: str,
    device: torch.device,
    rank: int,
    world: int,
    group_timeout_s: float,
    p2p_timeout_s: float,
    emulate_nccl: bool = False,
) -> None:
    """Join the run's process group (see the module docstring for the early import) and set up
    this process's transport: NCCL's manner on gloo with ``emulate_nccl``. Every group of the
    run has ``group_timeout_s``; ``p2p_timeout_s`` is how long the emulator's waits last."""
    import torch._dynamo  # noqa: F401  (before the group exists, so it keeps no reference)

    timeout = datetime.timedelta(seconds=group_timeout_s)
    store = attempt_store(rank, world, timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    if emulate_nccl:
        install(EmulatedNccl(rank, world, store, p2p_timeout_s, timeout))
    else:
        install(Transport(timeout))


def close_process_group() -> bool:
    """Stop the transport, destroy the process group and its subgroups; return whether their
    backends are really gone with them (nothing else still holds one) and the transport's
    threads with them."""
    transport = active()
    install(Transport())
    stopped = transport.close()  # first: its queues hold groups
    gc.collect()  # what only garbage holds (an engine's segment and its updates, a cycle)
    groups = list(distributed_c10d._world.pg_map)  # the default group and every subgroup
    name = dist.get_backend(dist.group.WORLD)
    dist.destroy_process_group()
    # minus the reference in `groups`, the loop's and getrefcount's argument
    held_elsewhere = [group for group in groups if sys.getrefcount(group) - 3 > 0]
    if held_elsewhere:
        _OUTLIVED.append(f"the {name} process group was still referenced after it was destroyed")
    if not stopped:
        _OUTLIVED.append("an emulated NCCL queue was still waiting in gloo when the run ended")
    return not held_elsewhere and stopped


def abort_process_group() -> None:
    """Stop the transport and abort the process group and its subgroups at once, waiting for
    nothing they hold (the module's docstring).

    NCCL's abort (``_abort_process_group``) returns at once. gloo's, like its destroy, waits for
    a collective in its queue (torch 2.13), so a gloo group is left as it is: the process's end
    closes its connections, and its peers see them close.
    """
    transport = active()
    install(Transport())
    transport.abort()
    name = dist.get_backend(dist.group.WORLD)
    if name == "nccl":
        distributed_c10d._abort_process_group()
    _ABORTED.append(name)


def exit_code(code: int) -> int:
    """``code``, or, if a backend outlived its group or was aborted, end the process now with
    ``code``.

    Ending the process skips interpreter teardown (and with it the threads' race); everything
    the run writes is closed by then, and standard output and error are flushed here.
    """
    if _OUTLIVED and first_process():  # one line a launch, not one per rank
        print(
            f"nobubble: note: {_OUTLIVED[0]}; exiting without interpreter teardown",
            file=sys.stderr,
        )
    if _OUTLIVED or _ABORTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
