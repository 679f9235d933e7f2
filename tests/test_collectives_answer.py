"""Every collective a pipeline process makes ends, when a peer has gone, in the one-line
:class:`~nobubble.pipeline.comm.PeerFailure`, never a traceback (docs/reliability.md, "Every
collective says who failed"). The fault campaign found two that did not: a gather outside the
transport whose peer had exited. So: a torch.distributed call in the pipeline and the launcher
either goes through the transport (an operation started with ``async_op=True`` and waited for by
the transport's caller, or the transport itself), or sits in a ``with peer_failures(...)`` block.
"""

import ast
from pathlib import Path

import pytest

from nobubble.pipeline.comm import PeerFailure
from nobubble.pipeline.replicas import peer_failures

SOURCE = Path(__file__).resolve().parents[1] / "src" / "nobubble"
CHECKED = [*sorted((SOURCE / "pipeline").glob("*.py")), *sorted((SOURCE / "run").glob("*.py"))]
TRANSPORT = {"transport.py", "emulated_nccl.py"}  # they are how operations reach torch
COLLECTIVES = {
    "barrier", "monitored_barrier", "gather_object", "all_gather_object",
    "broadcast_object_list", "scatter_object_list", "all_reduce", "all_gather",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
    "gather", "scatter", "reduce", "send", "recv", "isend", "irecv",
}  # fmt: skip


def _unanswered(path: Path) -> list[str]:
    """The collectives of ``path`` that are neither the transport's nor in peer_failures."""
    found = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call)
            and getattr(item.context_expr.func, "id", None) == "peer_failures"
            for item in node.items
        ):
            guarded = True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and getattr(node.func.value, "id", None) == "dist"
            and node.func.attr in COLLECTIVES
        ):
            started = any(
                k.arg == "async_op" and getattr(k.value, "value", None) is True
                for k in node.keywords
            )
            if not (guarded or started):
                found.append(f"{path.name}:{node.lineno} dist.{node.func.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text()), False)
    return found


def test_every_collective_goes_through_the_transport_or_answers_in_one_line():
    unanswered = [c for path in CHECKED if path.name not in TRANSPORT for c in _unanswered(path)]
    assert not unanswered, (
        f"{unanswered}: a peer that exits makes these raise gloo's or NCCL's own error (a "
        "traceback); put the call in `with peer_failures(name, what):`"
    )


def test_the_check_sees_a_bare_collective(tmp_path):
    """The scan itself: a bare gather is caught, the same in peer_failures or async is not."""
    source = tmp_path / "bare.py"
    source.write_text(
        "def f(dist, peer_failures):\n"
        "    dist.gather_object(1, None)\n"
        "    with peer_failures('stage 0', 'x'):\n"
        "        dist.barrier()\n"
        "    dist.all_reduce(t, async_op=True)\n"
    )
    assert _unanswered(source) == ["bare.py:2 dist.gather_object"]


def test_a_peers_error_becomes_the_one_line_peer_failure():
    closed = "Connection closed by peer [127.0.0.1]:3506"
    with pytest.raises(PeerFailure) as caught, peer_failures("stage 1", "the weight drift"):
        raise RuntimeError(closed)
    message = str(caught.value)
    assert message.startswith("stage 1 stopped waiting for the weight drift: one of them exited")
    assert message.endswith(closed) and "\n" not in message
    with pytest.raises(ValueError), peer_failures("stage 1", "x"):  # not a peer's: as it is
        raise ValueError("a bug")
