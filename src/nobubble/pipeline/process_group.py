"""The process group of a pipeline run: its rendezvous, its backend, and a teardown that holds.

Why the teardown needs care: in torch 2.13 the first optimizer a process builds imports
``torch._dynamo``, and when that import happens while a process group exists, it keeps about ten
references to the default group. ``destroy_process_group()`` then cannot free the backend: gloo's
worker and transport threads live on into interpreter shutdown, where their teardown races the
interpreter's and, now and then, ends a finished run in SIGABRT ("terminate called without an
active exception"). So :func:`open_process_group` imports ``torch._dynamo`` first, and
:func:`close_process_group` checks that nobody else still holds the group. If something does
(another library, a later torch), the process ends without interpreter teardown once its work is
done (:func:`exit_code`), so a finished job still exits with its code instead of crashing.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from nobubble.config import TrainConfig
from nobubble.device import resolve_device

_OUTLIVED: list[str] = []  # the backends that outlived close_process_group in this process


def device_and_backend(cfg: TrainConfig) -> tuple[torch.device, str]:
    """This rank's device (one GPU per local rank) and the process-group backend for it."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return device, "gloo"


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
    backend: str, device: torch.device, rank: int, world: int, timeout_s: float
) -> None:
    """Join the run's process group (see the module docstring for the early import)."""
    import torch._dynamo  # noqa: F401  (before the group exists, so it keeps no reference)

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        store=attempt_store(rank, world, timeout),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )


def close_process_group() -> bool:
    """Destroy the process group and its subgroups; return whether their backends are really
    gone with them (nothing else still holds one)."""
    groups = list(distributed_c10d._world.pg_map)  # the default group and every subgroup
    name = dist.get_backend(dist.group.WORLD)
    dist.destroy_process_group()
    # minus the reference in `groups`, the loop's and getrefcount's argument
    held_elsewhere = [group for group in groups if sys.getrefcount(group) - 3 > 0]
    if held_elsewhere:
        _OUTLIVED.append(name)
    return not held_elsewhere


def exit_code(code: int) -> int:
    """``code``, or, if a backend outlived its group, end the process now with ``code``.

    Ending the process skips interpreter teardown (and with it the threads' race); everything
    the run writes is closed by then, and standard output and error are flushed here.
    """
    if _OUTLIVED:
        print(
            f"nobubble: note: the {_OUTLIVED[0]} process group was still referenced after it "
            "was destroyed; exiting without interpreter teardown",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
