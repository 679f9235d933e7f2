"""NCCL's pairing and ordering on gloo: the transport of ``emulate_nccl=true``.

NCCL hangs where gloo does not because of these rules, which this transport adds to gloo:

- **Tags are ignored.** Between two ranks of a process group the n-th send pairs with the n-th
  receive. (Each message carries its tag and what it is ahead of its data, so a pairing of two
  different messages, which NCCL would make silently, is an error naming both.)
- **One operation at a time.** On each rank, each process group has one queue in which its
  point-to-point operations and collectives run one after another, in the order they were
  posted, as NCCL runs a communicator's kernels on one stream. A thread per queue runs them on
  gloo; posting never blocks, waiting blocks until the operation has run.
- **A send completes only once the peer's matching receive runs**: gloo completes a send when its
  receive is posted, and here a receive is posted only when its queue reaches it.
- **Connections are made on first use, and the first use blocks.** NCCL connects two ranks of a
  communicator for point-to-point the first time one sends to the other there, and that setup
  runs on the posting thread until the peer posts its own first operation of the pair (the
  receive from this rank; NCCL's own words: "send/recv connections are established on demand").
  So here a rank's first send to a peer on a group (and its first receive from one) blocks the
  caller until the peer has posted the matching first receive (send); a group's first
  collective blocks until every member has posted its first collective there. A runtime that
  posts a receive ahead on one group while its peer waits to post on another hangs at step 0,
  as on NCCL; :mod:`nobubble.pipeline.warmup` connects every group first, in one global order.
- **A peer that went away goes unnoticed.** Nothing tells NCCL on one node that a peer exited:
  an operation with it never completes. gloo notices (the connection closes); here the
  operation stays pending instead, and its queue runs nothing more, so a rank waiting for it
  gives up only after ``p2p_timeout_s``.

Everything else is gloo's: the same bytes arrive and the all-reduces sum in gloo's order, so a run
computes bitwise what it computes without the emulator. The control plane's own gloo group (the
go-ahead, stop votes, statistics: :class:`~nobubble.pipeline.links.Links`) is gloo on NCCL too,
and is not emulated; its waits are watched (:class:`_Watched`).

**When a wait gives up** (``p2p_timeout_s``), its error says what every rank had posted and not
finished. A monitor thread on each rank writes that rank's operations into the rendezvous store
once one of them (or a wait of its main thread) has been stuck for half the limit; the rank that
gives up adds its own and reads the others' as they are (it waits for none of them).

**The end.** NCCL's ``destroy_process_group()`` waits for every operation posted, and so does
:meth:`EmulatedNccl.close` (up to the group timeout, when NCCL's watchdog would abort them).
After an error, a receive posted ahead may never complete, so an error ends with
:meth:`EmulatedNccl.abort` instead, which stops the queues at once, as NCCL's abort does
(:func:`nobubble.pipeline.process_group.abort_process_group`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from nobubble.pipeline.transport import Launch, MismatchedMessages, Transport, Work

HEADER_BYTES = 96  # ahead of a message's data: its tag (8 bytes), what it is (UTF-8)
FOREVER = datetime.timedelta(days=1)  # a queue's own gloo waits: NCCL would wait as long
STUCK_KEY = "emulated_nccl/stuck/"  # + rank: what that rank had posted and not finished
CONNECT_KEY = "emulated_nccl/connect/"  # + group, then sender->receiver/side, or collective/rank
SHOWN = 4  # operations of a queue a report lists


class _Operation:
    """An operation posted on a queue: it runs there, in its turn (the emulator's ``Work``)."""

    def __init__(self, emulator: EmulatedNccl, queue: _Queue, label: str, body: Callable[[], None]):
        self.emulator, self.queue, self.label = emulator, queue, label
        self.body: Callable[[], None] | None = body
        self.done = threading.Event()
        self.error: Exception | None = None
        self.lost: Exception | None = None  # gloo's error: its peer went away
        self.started: float | None = None  # when it reached the head of its queue
        self.future: torch.futures.Future = torch.futures.Future()

    def run(self, broken: Exception | None) -> bool:
        """Run it (on the queue's thread); after a mismatch on the queue, fail at once. Whether
        it ended: one that gloo fails (its peer went away) never does, as on NCCL."""
        self.started = time.monotonic()
        if broken is not None:
            self.error = RuntimeError(
                f"an earlier operation on {self.queue.name} failed, and NCCL's communicator "
                f"fails with it: {broken}"
            )
        else:
            try:
                self.body()
            except MismatchedMessages as exc:
                self.error = exc
            except Exception as exc:  # gloo's: NCCL would not notice, and wait on
                self.lost = exc
        self.body = None  # let go of its tensors and group
        if self.lost is not None:
            return False
        self.done.set()
        self.future.set_result(None)
        return True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = self.emulator.limit if timeout is None else timeout.total_seconds()
        with self.emulator.awaiting(self.label):
            if not self.done.wait(limit):
                raise RuntimeError(self.emulator.hang_report(self.label, limit))
        if isinstance(self.error, MismatchedMessages):
            raise MismatchedMessages(str(self.error))
        if self.error is not None:
            raise RuntimeError(str(self.error))
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def describe(self, now: float) -> str:
        running = self.started is not None and not self.done.is_set()
        gone = "; its peer went away, which NCCL does not notice" if self.lost else ""
        return self.label + (f" (running {now - self.started:.0f}s{gone})" if running else "")


class _Queue:
    """What one rank posted on one process group, run one at a time in posting order by a
    thread of its own (NCCL: a communicator's kernels on its stream)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.operations: deque[_Operation] = deque()  # the head is the one running
        self.changed = threading.Condition()
        self.closing = False  # end once empty
        self.aborted = False  # end now
        self.broken: Exception | None = None
        self.thread = threading.Thread(target=self._serve, name=f"emulated NCCL {name}")
        self.thread.daemon = True  # one stuck in gloo must not keep a failed run alive
        self.thread.start()

    def post(self, operation: _Operation) -> None:
        with self.changed:
            self.operations.append(operation)
            self.changed.notify()

    def pending(self) -> list[_Operation]:
        with self.changed:
            return list(self.operations)

    def _serve(self) -> None:
        while True:
            with self.changed:
                while not (self.operations or self.closing or self.aborted):
                    self.changed.wait()
                if self.aborted or not self.operations:
                    return
                operation = self.operations[0]
            if not operation.run(self.broken):
                self._hold()
                return
            self.broken = self.broken or operation.error
            with self.changed:
                self.operations.popleft()

    def _hold(self) -> None:
        """Run nothing more until aborted, as a communicator's stream behind a kernel that never
        ends (what is posted stays pending: a graceful close waits for it)."""
        with self.changed:
            while not self.aborted:
                self.changed.wait()

    def close(self, timeout_s: float) -> bool:
        """Let the thread end once the queue is empty; whether it did within ``timeout_s``."""
        with self.changed:
            self.closing = True
            self.changed.notify()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def abort(self) -> None:
        """Run nothing more: the thread ends once the operation running (if any) returns."""
        with self.changed:
            self.aborted = True
            self.changed.notify()


class _Watched:
    """An operation of a group the emulator leaves to gloo (the control plane), whose waits its
    reports show."""

    def __init__(self, work: dist.Work, label: str, emulator: EmulatedNccl) -> None:
        self.work, self.label, self.emulator = work, label, emulator

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        started = time.monotonic()
        with self.emulator.awaiting(self.label):
            try:
                return self.work.wait() if timeout is None else self.work.wait(timeout)
            except RuntimeError as exc:
                waited = time.monotonic() - started
                if timeout is None or waited < 0.9 * timeout.total_seconds():
                    raise  # not a hang: the peer went away
                report = self.emulator.hang_report(self.label, waited)
                raise RuntimeError(f"{exc}\n{report}") from None

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self.work.get_future()


class EmulatedNccl(Transport):
    """gloo run as NCCL would run it (the module's docstring): rank ``rank`` of ``world``;
    ``store``: the rendezvous store, where stuck ranks leave their reports; ``timeout_s``: the
    waits' limit (``p2p_timeout_s``)."""

    emulated = True

    def __init__(
        self,
        rank: int,
        world: int,
        store: dist.Store | None,
        timeout_s: float,
        group_timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__(group_timeout)
        self.rank, self.world, self.limit = rank, world, timeout_s
        self.queues: dict[dist.ProcessGroup, _Queue] = {}
        self.connected: set[str] = set()  # this rank's sides of the connections made so far
        self.plain: set[dist.ProcessGroup] = set()  # gloo's own groups: not emulated
        self.posted: dict[tuple[dist.ProcessGroup, str, int], int] = {}  # messages so far
        self.waits: list[tuple[str, float]] = []  # what the main thread waits for, since when
        self.lock = threading.Lock()
        # the monitor's, the reports' and the connections' (None: no store, nothing connects)
        self.stores = [self._reporting(store), self._reporting(store), self._reporting(store)]
        self.published = False
        self.stopping = threading.Event()
        self.monitor = threading.Thread(target=self._watch, name="emulated NCCL monitor")
        self.monitor.daemon = True
        self.monitor.start()

    @property
    def pairs_by_tag(self) -> bool:
        return False

    @property
    def host_messages(self) -> bool:
        return True

    # -- posting --------------------------------------------------------------------------------

    def send(
        self, tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None, tag: int, label: str
    ) -> Work:
        group = _resolved(group)
        if group in self.plain:
            return _Watched(dist.isend(tensor, rank, group=group, tag=tag), label, self)
        self._connect(group, f"{self.rank}->{rank}", "send", "recv", label)
        number = self._count(group, "send", rank)

        def body() -> None:
            _finish(dist.isend(_header(tag, label), rank, group=group, tag=2 * number))
            _finish(dist.isend(tensor, rank, group=group, tag=2 * number + 1))

        return self._post(group, label, body)

    def recv(
        self, buffer: torch.Tensor, rank: int, group: dist.ProcessGroup | None, tag: int, label: str
    ) -> Work:
        group = _resolved(group)
        if group in self.plain:
            return _Watched(dist.irecv(buffer, rank, group=group, tag=tag), label, self)
        self._connect(group, f"{rank}->{self.rank}", "recv", "send", label)
        number = self._count(group, "recv", rank)

        def body() -> None:
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            _finish(dist.irecv(header, rank, group=group, tag=2 * number))
            sent_tag, sent = _read_header(header)
            if sent_tag != tag:
                raise MismatchedMessages(
                    f"NCCL would pair '{label}' with rank {rank}'s '{sent}' (its send number "
                    f"{number + 1} to this rank on {_group_name(group)}): between two ranks of "
                    "a group it pairs the n-th send with the n-th receive, whatever the tags, "
                    "and these two ranks post their messages in different orders"
                )
            _finish(dist.irecv(buffer, rank, group=group, tag=2 * number + 1))

        return self._post(group, label, body)

    def collective(
        self,
        group: dist.ProcessGroup | None,
        launch: Launch,
        label: str,
        device: torch.device,
    ) -> Work:
        group = _resolved(group)
        if group in self.plain:
            return _Watched(launch(), label, self)
        members = dist.get_process_group_ranks(group)
        others = [str(rank) for rank in members if rank != self.rank]
        self._connect(group, "collective", str(self.rank), others, label)

        def body() -> None:
            _finish(launch())
            if device.type == "cuda":  # done means the result is in place, as on the CPU
                torch.cuda.current_stream(device).synchronize()

        return self._post(group, label, body)

    def control_group(self) -> dist.ProcessGroup:
        group = super().control_group()
        self.plain.add(group)
        return group

    def _connect(
        self,
        group: dist.ProcessGroup,
        pair: str,
        side: str,
        peers: str | list[str],
        label: str,
    ) -> None:
        """Before this rank's first operation of ``pair`` on ``group`` (a one-way pair of
        ranks, or the group's collectives), say so in the store and block until the peers'
        sides (``peers``, under ``pair``) are there too: NCCL's lazy connection (the module's
        docstring). Nothing to do once connected, or without a store."""
        store = self.stores[2]
        prefix = f"{CONNECT_KEY}{group.group_name}/{pair}/"
        if store is None or prefix + side in self.connected:
            return
        store.set(prefix + side, "1")
        waited = [prefix + peer for peer in ([peers] if isinstance(peers, str) else peers)]
        what = (
            f"the connection for '{label}' on {_group_name(group)} (NCCL connects ranks on a "
            "group at their first operation there and blocks until the peer posts its own first)"
        )
        started = time.monotonic()
        with self.awaiting(what):
            delay = 0.001
            while not store.check(waited):
                if time.monotonic() - started > self.limit:
                    raise RuntimeError(self.hang_report(what, time.monotonic() - started))
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        self.connected.add(prefix + side)

    def _count(self, group: dist.ProcessGroup, direction: str, peer: int) -> int:
        """How many messages this rank has posted to (from) ``peer`` on ``group`` before."""
        key = (group, direction, peer)
        number = self.posted.get(key, 0)
        self.posted[key] = number + 1
        return number

    def _post(self, group: dist.ProcessGroup, label: str, body: Callable[[], None]) -> Work:
        with self.lock:
            queue = self.queues.get(group)
            if queue is None:
                queue = self.queues[group] = _Queue(_group_name(group))
        operation = _Operation(self, queue, label, body)
        queue.post(operation)
        return operation

    # -- hangs ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def awaiting(self, label: str) -> Iterator[None]:
        """While the main thread waits for the operation ``label``."""
        entry = (label, time.monotonic())
        with self.lock:
            self.waits.append(entry)
        try:
            yield
        finally:
            with self.lock:
                self.waits.remove(entry)

    def _pending(self) -> tuple[list[tuple[str, float]], list[tuple[str, list[_Operation]]]]:
        with self.lock:
            waits, queues = list(self.waits), list(self.queues.values())
        return waits, [(q.name, ops) for q in queues if (ops := q.pending())]

    def stuck_for(self) -> float:
        """How long the oldest running operation or wait of this rank has been going on."""
        waits, queues = self._pending()
        since = [s for _, s in waits] + [ops[0].started for _, ops in queues if ops[0].started]
        return time.monotonic() - min(since, default=time.monotonic())

    def snapshot(self) -> str:
        """What this rank waits for and every operation it posted that has not finished."""
        now = time.monotonic()
        waits, queues = self._pending()
        doing = "; ".join(f"{label} ({now - since:.0f}s)" for label, since in waits)
        lines = [f"rank {self.rank}: " + (f"waits for {doing}" if doing else "waits for nothing")]
        for name, operations in queues:
            shown = " | then ".join(op.describe(now) for op in operations[:SHOWN])
            more = len(operations) - SHOWN
            lines.append(f"  {name}: {shown}" + (f" | and {more} more" if more > 0 else ""))
        if not queues:
            lines.append("  nothing posted and unfinished on an emulated group")
        return "\n".join(lines)

    def hang_report(self, label: str, waited_s: float) -> str:
        """What every rank had posted and not finished: this rank's, and the others' as their
        monitors left them in the store (a rank not there yet is waited for a few seconds)."""
        mine = self.snapshot()
        self._publish(self.stores[1], mine)
        others = {rank: "" for rank in range(self.world) if rank != self.rank}
        deadline = time.monotonic() + min(5.0, self.limit / 4)
        while True:
            others |= {rank: self._read(rank) for rank, text in others.items() if not text}
            if all(others.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        silent = f"nothing of it stuck for {self.limit / 2:.0f}s or more"
        others = {rank: text or f"rank {rank}: {silent}" for rank, text in others.items()}
        return "\n".join(
            [
                f"emulated NCCL: {label} was not done after {waited_s:.0f}s. What each rank had "
                "posted and not finished (on each group a rank's operations run one at a time, "
                "in the order shown; between two ranks of a group the n-th send pairs with the "
                "n-th receive, whatever the tags):",
                mine,
                *others.values(),
            ]
        )

    def _watch(self) -> None:
        """The monitor: publish this rank's operations while one has been stuck for half the
        limit (and withdraw them when it no longer is)."""
        while not self.stopping.wait(min(self.limit / 8, 2.0)):
            stuck = self.stuck_for() >= self.limit / 2
            if stuck or self.published:
                self._publish(self.stores[0], self.snapshot() if stuck else "")
                self.published = stuck

    def _publish(self, store: dist.Store | None, text: str) -> None:
        if store is None:
            return
        with contextlib.suppress(Exception):  # the store's host is gone: nobody would read it
            store.set(f"{STUCK_KEY}{self.rank}", text)

    def _read(self, rank: int) -> str:
        """What ``rank`` left in the store ("" if nothing)."""
        key, store = f"{STUCK_KEY}{rank}", self.stores[1]
        try:
            return store.get(key).decode() if store is not None and store.check([key]) else ""
        except Exception as exc:  # its host (rank 0, or torchrun's agent) is gone
            return f"rank {rank}: unknown (the rendezvous store did not answer: {exc})"

    def _reporting(self, store: dist.Store | None) -> dist.Store | None:
        """A connection of its own to the rendezvous store, quick to give up."""
        if store is None:
            return None
        clone = store.clone()
        clone.set_timeout(datetime.timedelta(seconds=min(10.0, self.limit / 4)))
        return clone

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> bool:
        """NCCL's graceful close (``destroy_process_group()``): wait for every operation posted
        to finish, up to the group timeout (then NCCL's watchdog would abort it), stop the
        monitor and let go of the groups; whether every thread ended. A receive posted ahead
        whose send will never come holds it that long: an error ends with :meth:`abort`."""
        limit = self.group_timeout.total_seconds() if self.group_timeout else self.limit
        deadline = time.monotonic() + limit
        self.stopping.set()
        self.monitor.join()
        queues = self._let_go()
        return all([queue.close(max(0.0, deadline - time.monotonic())) for queue in queues])

    def abort(self) -> None:
        """Stop the monitor and the queues at once, whatever they hold (NCCL's abort); a
        thread stuck in gloo ends with the process."""
        self.stopping.set()
        for queue in self._let_go():
            queue.abort()

    def _let_go(self) -> list[_Queue]:
        """Forget the groups; their queues, to be closed or aborted."""
        with self.lock:
            queues = list(self.queues.values())
            self.queues.clear()
        self.plain.clear()
        self.posted.clear()
        self.connected.clear()
        return queues


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def _group_name(group: dist.ProcessGroup) -> str:
    ranks = ", ".join(map(str, dist.get_process_group_ranks(group)))
    if group == dist.group.WORLD:
        return f"the default group (ranks {ranks})"
    named = group.group_desc not in ("", "undefined")
    return f"group '{group.group_desc}' (ranks {ranks})" if named else f"group of ranks {ranks}"


def _finish(work: dist.Work) -> None:
    work.wait(FOREVER)


def _header(tag: int, label: str) -> torch.Tensor:
    data = tag.to_bytes(8, "little") + label.encode()[: HEADER_BYTES - 8]
    return torch.frombuffer(bytearray(data.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8)


def _read_header(header: torch.Tensor) -> tuple[int, str]:
    raw = header.numpy().tobytes()
    return int.from_bytes(raw[:8], "little"), raw[8:].rstrip(b"\0").decode(errors="replace")
