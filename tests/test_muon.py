"""Muon's Newton–Schulz orthogonalization in a chosen dtype (nobubble.optim.muon).

In bfloat16 the update is torch.optim.Muon's, bitwise. In float32 it is the same iteration with
less rounding: it must land every singular value in the polynomial's band, and agree with the
bfloat16 result to bfloat16's precision.
"""

import json

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C

from nobubble.cli import main
from nobubble.optim.muon import Muon, ns_dtype, orthogonalize
from tests.helpers.pipeline import SMALL

# phi(x) = a·x + b·x³ + c·x⁵, iterated five times, takes every x in [0.05, 1] into [0.6818, 1.1344],
# an interval phi maps into itself (computed on a fine grid; the coefficients trade convergence to
# 1 for a steep start). A singular value of the normalized input (divided by the Frobenius norm,
# so all are <= 1) that starts above 0.05 ends there; the margin is for float32 rounding.
BAND = (0.681, 1.135)


def known_spectrum(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A rows x cols matrix with singular values spread over [1, 2]: each above 0.05 of the
    Frobenius norm for up to ~100 singular values."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen))
    return u @ torch.diag(torch.linspace(1.0, 2.0, k)) @ v.T


def phi(x: float) -> float:
    return DEFAULT_A * x + DEFAULT_B * x**3 + DEFAULT_C * x**5


def test_the_band_is_where_five_iterations_take_the_normalized_spectrum():
    grid = [0.05 + i * 0.95 / 10_000 for i in range(10_001)]
    for _ in range(5):
        grid = [phi(x) for x in grid]
    assert BAND[0] <= min(grid) and max(grid) <= BAND[1]
    assert min(grid) < BAND[0] + 1e-3 and max(grid) > BAND[1] - 1e-3  # and the band is tight


@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (48, 48)])
def test_float32_orthogonalizes_into_the_polynomials_band(shape):
    ortho = orthogonalize(known_spectrum(*shape, seed=1), torch.float32)
    assert ortho.dtype == torch.float32 and ortho.shape == shape
    singular = torch.linalg.svdvals(ortho)
    assert BAND[0] <= singular.min().item() and singular.max().item() <= BAND[1]


@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (48, 48)])
def test_float32_agrees_with_bfloat16_to_bfloat16_precision(shape):
    """bfloat16 keeps 8 significant bits (a relative 2^-8 ≈ 0.4% per rounding), and the
    iteration's slope (up to 3.4) amplifies early roundings: measured 1.6% to 2.2% apart in the
    Frobenius norm on such matrices; 5% bounds it. A wrong iteration (another orientation,
    no normalization, other coefficients) is off by order 1."""
    matrix = known_spectrum(*shape, seed=2)
    full, half = orthogonalize(matrix, torch.float32), orthogonalize(matrix, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert ((full - half.float()).norm() / full.norm()).item() < 0.05


def test_orthogonalize_leaves_its_input_alone():
    """In float32 the cast is no copy; the caller's tensor (Muon's momentum buffer, without
    Nesterov) must not be normalized in place."""
    matrix = known_spectrum(16, 8, seed=3)
    before = matrix.clone()
    orthogonalize(matrix, torch.float32)
    assert torch.equal(matrix, before)


@pytest.mark.parametrize("nesterov", [True, False])
def test_bfloat16_is_torch_muon_bitwise(nesterov):
    gen = torch.Generator().manual_seed(4)
    shapes = [(12, 4), (4, 12), (6, 6)]
    ours = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    mine = Muon(ours, ns_dtype=torch.bfloat16, adjust_lr_fn="match_rms_adamw", **settings)
    torch_muon = torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **settings)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        mine.step()
        torch_muon.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert mine.state_dict()["param_groups"] == torch_muon.state_dict()["param_groups"]


def test_float32_muon_keeps_its_momentum_buffer_an_average_of_gradients():
    param = torch.nn.Parameter(torch.zeros(8, 4))
    opt = Muon([param], ns_dtype=torch.float32, lr=0.01, momentum=0.5, nesterov=False)
    param.grad = known_spectrum(8, 4, seed=5)
    opt.step()
    assert torch.equal(opt.state[param]["momentum_buffer"], 0.5 * param.grad)


def pretend_cpu(monkeypatch, **features: bool) -> None:
    """Make torch report these CPU features (x86 names, as torch.cpu.get_capabilities)."""
    monkeypatch.setattr(
        torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", **features}
    )


@pytest.mark.parametrize(
    ("features", "dtype"),
    [
        ({"avx2": True, "avx512_f": True}, torch.float32),  # bfloat16 emulated or generic: slow
        ({"avx512_f": True, "avx512_bf16": True}, torch.bfloat16),
        ({"amx_tile": True, "amx_bf16": True}, torch.bfloat16),
    ],
)
def test_auto_on_a_cpu_is_bfloat16_only_with_bfloat16_matrix_instructions(
    monkeypatch, features, dtype
):
    pretend_cpu(monkeypatch, **features)
    assert ns_dtype("auto", torch.device("cpu")) == dtype


def test_auto_on_cuda_is_bfloat16_and_a_given_dtype_is_kept(monkeypatch):
    """No GPU is needed to name a CUDA device; the answer depends on no rank's state."""
    pretend_cpu(monkeypatch, avx2=True)
    assert ns_dtype("auto", torch.device("cuda", 3)) == torch.bfloat16
    for device in ("cpu", "cuda"):
        assert ns_dtype("float32", torch.device(device)) == torch.float32
        assert ns_dtype("bfloat16", torch.device(device)) == torch.bfloat16


def test_a_muon_run_records_what_its_setting_resolved_to(tmp_path, monkeypatch):
    pretend_cpu(monkeypatch, avx2=True)
    out = tmp_path / "run"
    settings = [*SMALL, "optim=muon", "steps=1", "eval_batches=1", "device=cpu"]
    assert main(["train", "--no-progress", "--out", str(out), *settings]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["muon_ns_dtype"] == "float32"
    assert json.loads((out / "config.json").read_text())["muon_ns_dtype"] == "auto"
