"""Blockwise Muon (``muon_blocks``): each hidden matrix orthogonalized in the blocks tensor
parallelism would hold (nobubble.model.tensor_split), each scaled by its own shape."""

import pytest
import torch

from nobubble.config import ConfigError
from nobubble.configure import build_config
from nobubble.model.tensor_split import Split, blocks, split_dim, split_of
from nobubble.optim.muon import Muon, adjust_lr, momentum_direction, orthogonalize
from nobubble.optim.registry import build_optimizer
from tests.helpers.pipeline import assert_same_run, nobubble
from tests.helpers.runs import resume, train

SETTINGS = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}


def named_params(
    shapes: dict[str, tuple[int, int]], seed: int
) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, torch.nn.Parameter(torch.randn(*shape, generator=gen)))
        for name, shape in shapes.items()
    ]


@pytest.mark.parametrize(
    ("name", "split", "dim"),
    [
        ("blocks.0.attn.wq.weight", Split.COLUMN, 0),
        ("blocks.3.attn.wk.weight", Split.COLUMN, 0),
        ("blocks.3.attn.wv.weight", Split.COLUMN, 0),
        ("blocks.1.attn.wo.weight", Split.ROW, 1),
        ("blocks.2.mlp.w_gate.weight", Split.COLUMN, 0),
        ("blocks.2.mlp.w_up.weight", Split.COLUMN, 0),
        ("blocks.2.mlp.w_down.weight", Split.ROW, 1),
        ("blocks.1.mlp.shared.w_up.weight", Split.COLUMN, 0),  # a MoE block's shared expert
        ("blocks.1.mlp.shared.w_down.weight", Split.ROW, 1),
    ],
)
def test_the_split_rule_per_parameter(name, split, dim):
    assert split_of(name) is split
    assert split_dim(name) == dim
    tensor = torch.arange(24.0).reshape(4, 6)
    parts = blocks(tensor, name, 2)
    assert [tuple(p.shape) for p in parts] == ([(2, 6)] * 2 if dim == 0 else [(4, 3)] * 2)
    assert torch.equal(torch.cat(parts, dim=dim), tensor)
    parts[1].zero_()  # views: writing a block writes the tensor
    half = tensor.shape[dim] // 2
    assert not tensor.narrow(dim, half, half).any() and tensor.narrow(dim, 0, half).any()


@pytest.mark.parametrize(
    "name",
    ["embed.weight", "head.weight", "blocks.0.mlp.router.weight", "blocks.0.attn_norm.weight"],
)
def test_what_tensor_parallelism_does_not_split_by_the_rule(name):
    assert split_of(name) is None
    with pytest.raises(ValueError) as caught:
        split_dim(name)
    assert name in str(caught.value) and "tensor_split.py" in str(caught.value)
    assert "muon_blocks=1" in str(caught.value)


def test_one_block_is_torch_muon_bitwise():
    """muon_blocks=1 is the whole-matrix Muon: in bfloat16, torch's own update, bitwise."""
    shapes = {"blocks.0.attn.wq.weight": (8, 12), "blocks.0.mlp.w_down.weight": (12, 6)}
    ours = named_params(shapes, seed=1)
    theirs = [torch.nn.Parameter(p.detach().clone()) for _, p in ours]
    mine = Muon([{"params": ours}], ns_dtype=torch.bfloat16, blocks=1, **SETTINGS)
    torch_muon = torch.optim.Muon(theirs, **SETTINGS)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for (_, a), b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        mine.step()
        torch_muon.step()
    for (_, a), b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("name", "dim"), [("blocks.0.attn.wk.weight", 0), ("blocks.0.attn.wo.weight", 1)]
)
def test_two_blocks_are_the_two_halves_orthogonalized_by_hand(name, dim):
    ((_, param),) = named_params({name: (8, 6)}, seed=3)
    start = param.detach().clone()
    opt = Muon([{"params": [(name, param)]}], ns_dtype=torch.float32, blocks=2, **SETTINGS)
    param.grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    opt.step()

    direction = momentum_direction(param.grad, torch.zeros_like(param.grad), 0.95, True)
    expected = start.mul(1 - SETTINGS["lr"] * SETTINGS["weight_decay"])
    half = (4, 6) if dim == 0 else (8, 3)
    for part, target in zip(direction.chunk(2, dim), expected.chunk(2, dim), strict=True):
        ortho = orthogonalize(part, torch.float32)
        target.add_(ortho, alpha=-adjust_lr(SETTINGS["lr"], "match_rms_adamw", half))
    assert torch.equal(param.detach(), expected)

    whole = start.mul(1 - SETTINGS["lr"] * SETTINGS["weight_decay"])
    whole.add_(
        orthogonalize(direction, torch.float32), alpha=-adjust_lr(0.02, "match_rms_adamw", (8, 6))
    )
    assert (param.detach() - whole).abs().max().item() > 1e-3  # another update than the whole's


def test_the_setting_reaches_the_hidden_matrices_only():
    """The hidden matrices' Muon takes muon_blocks; embeddings, head and gains stay AdamW's."""
    cfg = build_config({"optim": "muon", "muon_blocks": 2})
    shapes = {
        "embed.weight": (16, 8),
        "blocks.0.attn.wq.weight": (8, 8),
        "blocks.0.mlp.w_down.weight": (8, 4),
    }
    optimizer = build_optimizer(named_params(shapes, seed=5), cfg)
    muons = [part for part in optimizer.optimizers if isinstance(part, Muon)]
    assert [m.blocks for m in muons] == [2]
    assert muons[0].param_groups[0]["param_names"] == [
        "blocks.0.attn.wq.weight",
        "blocks.0.mlp.w_down.weight",
    ]


def test_a_block_may_hold_a_fraction_of_a_head():
    """d_model 32 over 4 heads of 8, 2 kv heads: k and v have 16 rows, 4 blocks of 4 rows each
    (half a head); allowed (docs/optimizers.md)."""
    cfg = build_config(
        {
            "optim": "muon",
            "muon_blocks": 4,
            "d_model": 32,
            "n_heads": 4,
            "n_kv_heads": 2,
            "d_ff": 64,
        }
    )
    assert cfg.muon_blocks == 4


def test_a_split_dimension_not_divisible_is_refused_naming_the_matrix_and_the_fix():
    with pytest.raises(ConfigError) as caught:  # d_ff 352 = 32 x 11: 3 divides no dimension
        build_config(
            {
                "optim": "muon",
                "muon_blocks": 3,
                "d_model": 128,
                "n_heads": 4,
                "n_kv_heads": 2,
                "d_ff": 352,
            }
        )
    message = str(caught.value)
    assert "muon_blocks=3" in message and "blocks.0.attn.wq.weight" in message
    assert "choose muon_blocks among 1, 2, 4, 8, 16, 32" in message  # gcd(128, 64, 352) = 32
    with pytest.raises(ConfigError) as caught:  # kv rows 2 x 32 = 64: 128 blocks divide only q
        build_config(
            {"optim": "muon", "muon_blocks": 128, "d_model": 128, "n_heads": 4, "n_kv_heads": 2}
        )
    assert "blocks.0.attn.wk.weight" in str(caught.value)


def test_the_optimizer_refuses_an_indivisible_matrix_it_is_given():
    params = named_params({"blocks.0.mlp.w_down.weight": (8, 6)}, seed=6)
    with pytest.raises(ValueError, match=r"muon_blocks=4: blocks.0.mlp.w_down.weight \(8, 6\)"):
        Muon([{"params": params}], blocks=4)


@pytest.mark.parametrize("optim", ["adamw", "soap"])
def test_blocks_with_another_optimizer_are_refused(optim):
    with pytest.raises(ConfigError) as caught:
        build_config({"optim": optim, "muon_blocks": 2})
    message = str(caught.value)
    assert "muon_blocks=2" in message and f"optim={optim}" in message
    assert "set muon_blocks=1, or optim=muon" in message


def test_a_resume_with_other_blocks_is_refused(tmp_path, capsys):
    assert train(tmp_path / "r", "optim=muon", "muon_blocks=2", "steps=2") == 0
    assert resume(tmp_path / "r", "muon_blocks=4") == 2
    err = capsys.readouterr().err
    assert f"cannot continue {tmp_path / 'r'} with muon_blocks=4" in err
    assert "trained with muon_blocks=2" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_pipeline_matches_one_process_with_two_blocks(tmp_path):
    settings = ["schedule=2bw", "stages=2", "microbatches=2", "steps=6", "eval_every=3"]
    settings += ["optim=muon", "muon_ns_dtype=float32", "muon_blocks=2", "ef=true"]
    nobubble(tmp_path / "pipeline", *settings, stages=2)
    nobubble(tmp_path / "simulated", *settings)
    assert_same_run(tmp_path / "pipeline", tmp_path / "simulated")
