"""Which process group carries each pipeline message (nobubble.pipeline.links): the mapping,
without processes. The runs over these routes are in test_pipeline_parity.py and
test_data_parallel.py (``p2p_routes=per-edge``), and under the NCCL emulator in
test_emulated_nccl.py."""

import datetime

import pytest

from nobubble.config import ConfigError
from nobubble.layout import ParallelLayout
from nobubble.pipeline import links as links_module
from nobubble.pipeline.channels import Channel
from nobubble.pipeline.emulated_nccl import EmulatedNccl
from nobubble.pipeline.links import Links, resolve_links
from nobubble.pipeline.transport import Transport, active, install


@pytest.fixture
def groups(monkeypatch):
    """dist.new_group recorded: each call returns ("group", its ranks, its backend, its number);
    the default backend is gloo unless a test says otherwise."""
    made = []

    def new_group(ranks=None, timeout=None, backend=None, group_desc=None):
        made.append(("group", tuple(ranks) if ranks else None, backend, len(made)))
        return made[-1]

    monkeypatch.setattr(links_module.dist, "new_group", new_group)
    monkeypatch.setattr(links_module.dist, "get_backend", lambda: "gloo")
    return made


@pytest.fixture
def emulated():
    """The NCCL emulator as this process's transport (no process group: nothing is posted)."""
    emulator = EmulatedNccl(rank=0, world=4, store=None, timeout_s=60.0)
    install(emulator)
    yield emulator
    install(Transport())
    assert emulator.close()


def test_auto_routes_follow_the_backend():
    assert resolve_links("auto", "gloo") == "shared"
    assert resolve_links("auto", "nccl") == "per-edge"
    assert resolve_links("per-edge", "gloo") == "per-edge"
    with pytest.raises(ConfigError, match=r"nccl pairs them in posting order.*p2p_routes=per-edge"):
        resolve_links("shared", "nccl")


def test_under_the_emulator_auto_routes_are_nccls_and_shared_ones_are_allowed():
    """auto takes NCCL's routes; shared stays possible, to show the hang NCCL would have."""
    assert resolve_links("auto", "gloo", emulated=True) == "per-edge"
    assert resolve_links("shared", "gloo", emulated=True) == "shared"


def test_every_group_takes_the_runs_group_timeout_not_torchs_default(monkeypatch):
    """dist.new_group gives NCCL's 10 minutes whatever the default group has: the transport
    passes group_timeout_s to every group it makes (the edges' and the control plane's)."""
    timeouts = []

    def new_group(ranks=None, timeout=None, backend=None, group_desc=None):
        timeouts.append(timeout)
        return object()

    monkeypatch.setattr(links_module.dist, "new_group", new_group)
    monkeypatch.setattr(links_module.dist, "get_backend", lambda: "nccl")
    install(Transport(datetime.timedelta(seconds=1800)))
    try:
        Links.build(ParallelLayout(pp=3), "per-edge")
    finally:
        install(Transport())
    assert timeouts == [datetime.timedelta(seconds=1800)] * (3 * 2 + 1)  # edges, control


def test_shared_routes_use_the_default_group_for_everything(groups):
    routes = Links.build(ParallelLayout(pp=4), "shared")
    assert groups == []
    assert all(routes.group(c, 1, 0) is None for c in Channel)
    assert all(routes.on_cpu(c) for c in Channel)  # gloo: from host memory (on a CPU: no copy)
    assert routes.hang_hint() == ""  # gloo pairs by tag: no hang to explain


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_per_edge_routes_give_every_edge_and_data_channel_its_own_two_rank_group(
    groups, monkeypatch, backend
):
    monkeypatch.setattr(links_module.dist, "get_backend", lambda: backend)
    # 2 processes x 2 chunks (model stages 0, 2 on pp rank 0; 1, 3 on pp rank 1) x 2 replicas:
    # ranks pp_rank * 2 + replica
    layout = ParallelLayout(pp=2, dp=2, chunks=2)
    routes = Links.build(layout, "per-edge")
    data = [g for g in groups if g[2] is None]
    assert len(data) == 3 * 3 * 2  # channels x stage edges x replicas, all distinct
    for replica in range(2):
        for stage in range(3):  # edge stage -> stage + 1
            ranks = tuple(
                sorted({layout.rank_of(stage, replica), layout.rank_of(stage + 1, replica)})
            )
            act = routes.group(Channel.ACTIVATION, stage + 1, replica)
            grad = routes.group(Channel.GRADIENT, stage, replica)
            evals = routes.group(Channel.EVAL_ACTIVATION, stage + 1, replica)
            assert act[1] == grad[1] == evals[1] == ranks
            assert len({act, grad, evals}) == 3
    # the wrap-around edge 1 -> 2 runs between the same two processes as 0 -> 1, the other way
    assert routes.group(Channel.ACTIVATION, 2, 0) != routes.group(Channel.ACTIVATION, 1, 0)
    control = [c for c in Channel if c not in links_module.DATA_CHANNELS]
    if backend == "gloo":  # tags hold on the default group; gloo sends from host memory
        assert all(routes.group(c, 0, 0) is None for c in control)
        assert all(routes.on_cpu(c) for c in Channel)
    else:  # NCCL: control messages on one gloo group over every rank, as CPU tensors
        assert groups[-1] == ("group", None, "gloo", len(groups) - 1)
        assert all(routes.group(c, 0, 1) == groups[-1] and routes.on_cpu(c) for c in control)
        assert not any(routes.on_cpu(c) for c in links_module.DATA_CHANNELS)


def test_under_the_emulator_control_messages_take_a_gloo_group_it_leaves_alone(groups, emulated):
    """As on NCCL: data on two-rank groups (emulated), control on one gloo group (not)."""
    routes = Links.build(ParallelLayout(pp=2), "per-edge")
    assert groups[-1] == ("group", None, "gloo", len(groups) - 1)
    assert routes.control == groups[-1] and emulated.plain == {groups[-1]}
    assert all(routes.on_cpu(c) for c in Channel)
    assert routes.hang_hint() == ""  # per-edge routes: no shared group to blame


def test_under_the_emulator_shared_routes_point_at_per_edge_ones_when_a_wait_gives_up(
    groups, emulated
):
    routes = Links.build(ParallelLayout(pp=2), "shared")
    assert active() is emulated and routes.control is None
    assert "use p2p_routes=per-edge" in routes.hang_hint()
