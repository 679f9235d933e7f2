"""nobubble plan: stage costs by hand, predictions against the simulator's own arithmetic, the
all-reduce rule, memory, and the command."""

import argparse
import dataclasses
import json
import re

import pytest

from nobubble.config import ConfigError, zero_problem
from nobubble.config.parallel import ParallelSettings
from nobubble.model.presets import ModelConfig
from nobubble.planning import cli as plan_cli
from nobubble.planning import estimate as estimate_module
from nobubble.planning.costs import stage_costs
from nobubble.planning.estimate import ClusterPlan, estimate, shape_problem
from nobubble.planning.grid import grid
from nobubble.planning.hardware import DEVICES, LINKS
from nobubble.planning.shapes import LLAMA3_FAMILY, PLANNING_SHAPES
from nobubble.schedules import SCHEDULE_NAMES, generate
from nobubble.schedules.registry import PIPELINE_SCHEDULES, SYNCHRONOUS_SCHEDULES

SHAPE = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                    vocab_size=100)  # fmt: skip


def test_stage_costs_by_hand():
    first, last = stage_costs(SHAPE, 2, seq_len=8, microbatch_size=2)
    tokens = 16
    block_weights = 2 * 64 * 16 * (4 + 2) + 3 * 64 * 128  # q,o + k,v; gate, up, down
    block_flops = 2 * block_weights + 4 * 4 * 16 * 8  # matmuls + scores and weighted sum
    assert (first.blocks, last.blocks) == (1, 1)
    assert first.forward_flops == block_flops * tokens
    assert last.forward_flops == (block_flops + 2 * 64 * 100) * tokens
    assert first.weight_flops == 2 * block_weights * tokens  # W: no attention scores
    assert last.weight_flops == (2 * block_weights + 2 * 64 * 100) * tokens
    assert first.parameters == block_weights + 2 * 64 + 64 * 100  # + 2 norms, the embedding
    assert last.parameters == block_weights + 2 * 64 + 64 + 64 * 100  # + final norm, head
    assert first.activation_bytes == 34 * tokens * 64
    assert last.activation_bytes == 34 * tokens * 64 + 4 * tokens * 100
    assert first.message_bytes == 2 * tokens * 64


PARALLEL = {f.name for f in dataclasses.fields(ParallelSettings)}


def plan(**changes) -> ClusterPlan:
    """The test's plan with ``changes``: the parallel section's (stages, dp, ...) and the plan's."""
    shape = {key: changes.pop(key) for key in PARALLEL & changes.keys()}
    base = ClusterPlan(
        model=dataclasses.replace(SHAPE, n_layers=8),
        parallel=ParallelSettings(**{"stages": 4, "microbatches": 8, **shape}), microbatch_size=2,
        seq_len=32, device=DEVICES["h100"], mfu=0.5,
        p2p=dataclasses.replace(LINKS["ib-ndr"], latency_us=0.0, gb_per_s=1e12),
        allreduce=LINKS["ib-ndr"],
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def stage_seconds(p: ClusterPlan, chunks: int = 1) -> list[float]:
    costs = stage_costs(p.model, p.parallel.stages * chunks, p.seq_len, p.microbatch_size)
    return [3 * c.forward_flops / (p.device.peak_tflops * 1e12 * p.mfu) for c in costs]


def test_2bw_runs_at_its_slowest_stage_and_1f1b_pays_a_fill_and_drain():
    p = plan()
    per_microbatch = stage_seconds(p)  # F + B of one microbatch per stage
    two = estimate(p, "2bw")
    assert two.step_s == pytest.approx(p.parallel.microbatches * max(per_microbatch), rel=1e-9)
    assert two.tokens_per_s == pytest.approx(8 * 2 * 32 / two.step_s)
    one = estimate(p, "1f1b")
    assert one.step_s > two.step_s
    assert one.step_s >= (p.parallel.microbatches + p.parallel.stages - 1) * min(per_microbatch)
    assert estimate(p, "gpipe").peak_memory_gb > one.peak_memory_gb  # M activations vs P-s


def test_memory_of_1f1b_first_rank_by_hand():
    p = plan()
    first = stage_costs(p.model, 4, p.seq_len, p.microbatch_size)[0]
    expected = first.parameters * (2 + 16) + 4 * first.activation_bytes  # 1 version, P in flight
    assert estimate(p, "1f1b").memory_gb[0] == pytest.approx(expected / 1e9)
    two = stage_costs(p.model, 4, p.seq_len, p.microbatch_size)[0]
    assert estimate(p, "2bw").memory_gb[0] == pytest.approx(
        (two.parameters * (2 * 2 + 16) + 4 * two.activation_bytes) / 1e9
    )  # two weight versions


@pytest.mark.parametrize(
    ("zero", "schedule", "per_parameter"),
    [
        # BF16 versions + FP32 gradient + 12 bytes of master weight and moments (1/dp with
        # zero > 0) + under 2bw the reduced gradient held while the next one accumulates
        # (1/dp of it with zero=2); dp = 4
        (0, "1f1b", 2 + 4 + 12),
        (1, "1f1b", 2 + 4 + 3),
        (2, "1f1b", 2 + 4 + 3),
        (0, "2bw", 2 * 2 + 4 + 12 + 4),
        (1, "2bw", 2 * 2 + 4 + 3 + 4),
        (2, "2bw", 2 * 2 + 4 + 3 + 1),
    ],
)
def test_memory_with_sharded_state_by_hand(zero, schedule, per_parameter):
    p = plan(dp=4, zero=zero)
    first = stage_costs(p.model, 4, p.seq_len, p.microbatch_size)[0]
    expected = first.parameters * per_parameter + 4 * first.activation_bytes  # P in flight
    assert estimate(p, schedule).memory_gb[0] == pytest.approx(expected / 1e9)


def test_activation_checkpointing_keeps_block_inputs_and_recomputes_by_hand():
    first, last = stage_costs(SHAPE, 2, seq_len=8, microbatch_size=2, activation_checkpointing=True)
    tokens, block_weights = 16, 2 * 64 * 16 * (4 + 2) + 3 * 64 * 128
    block_flops = 2 * block_weights + 4 * 4 * 16 * 8
    assert first.activation_bytes == 2 * tokens * 64  # the block's input, 16 bits
    assert last.activation_bytes == 2 * tokens * 64 + 4 * tokens * 100  # + FP32 logits
    assert first.recompute_bytes == last.recompute_bytes == 34 * tokens * 64  # one block live
    assert first.recompute_flops == last.recompute_flops == block_flops * tokens  # no head
    p = plan(activation_checkpointing=True)
    costs = stage_costs(p.model, 4, p.seq_len, p.microbatch_size, activation_checkpointing=True)
    rate = p.device.peak_tflops * 1e12 * p.mfu
    per_microbatch = [(3 * c.forward_flops + c.recompute_flops) / rate for c in costs]
    assert estimate(p, "2bw").step_s == pytest.approx(p.parallel.microbatches * max(per_microbatch))
    held = costs[0].parameters * 18 + 4 * costs[0].activation_bytes + costs[0].recompute_bytes
    assert estimate(p, "1f1b").memory_gb[0] == pytest.approx(held / 1e9)


def test_sharded_traffic_is_a_reduction_and_a_gather_of_the_new_weights():
    p = plan(dp=4)
    share = 3 / 4
    assert estimate_module.dp_bytes_per_parameter(p, 4) == 2 * share * 4  # ring all-reduce, FP32
    one, two = plan(dp=4, zero=1), plan(dp=4, zero=2)
    assert estimate_module.dp_bytes_per_parameter(one, 4) == 2 * share * 4 + share * 2  # + BF16
    assert estimate_module.dp_bytes_per_parameter(two, 4) == share * 4 + share * 2


def test_the_allreduce_is_exposed_after_a_flush_and_hidden_under_2bw():
    ring = 2 * 3 / 4  # dp = 4
    costs = stage_costs(plan().model, 4, 32, 2)
    for gb_per_s in (1e6, 50.0):  # an all-reduce shorter, then longer, than a step's compute
        p = plan(dp=4, allreduce=dataclasses.replace(LINKS["ib-ndr"], gb_per_s=gb_per_s))
        allreduce = [ring * 4 * c.parameters / (gb_per_s * 1e9) for c in costs]
        busy = [p.parallel.microbatches * t for t in stage_seconds(p)]
        one, alone = estimate(p, "1f1b"), estimate(plan(), "1f1b")
        assert one.exposed_dp_s == pytest.approx(max(allreduce))
        assert one.step_s == pytest.approx(alone.step_s + max(allreduce))
        hidden = max(max(a - b, 0.0) for a, b in zip(allreduce, busy, strict=True))
        assert estimate(p, "2bw").exposed_dp_s == pytest.approx(hidden)
        assert (hidden == 0.0) == (gb_per_s == 1e6)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(list(argv)))


def test_plan_prints_every_schedule_and_the_best_that_fits(capsys):
    args = ("--preset", "small", "--seq-len", "256", "--stages", "2", "--microbatches", "4")
    assert cli(*args) == 0
    out = capsys.readouterr().out
    for name in PIPELINE_SCHEDULES:  # zb-v and dualpipev among them
        assert f"| {name} |" in out
    # M = 2P: ZB-H2 has no steady bubble, and its kept-back W's hide the message latency that
    # 2bw's one-forward-one-backward order waits for
    assert "best under 80 GB per GPU: zb-h2" in out
    assert cli(*args, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"] == "zb-h2" and len(data["predictions"]) == 9
    assert cli(*args, "--microbatches", "3") == 0  # M not a multiple of P: explained, not run
    out = capsys.readouterr().out
    assert "interleaved-1f1b: not predicted: " in out
    assert "dualpipev: not predicted: dualpipev needs microbatches >= 2 x stages" in out
    assert (
        cli(
            "--preset",
            "llama3-8b",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--memory-limit-gb",
            "1",
        )
        == 0
    )
    assert "no schedule fits in 1 GB per GPU" in capsys.readouterr().out


def row(out: str, schedule: str) -> list[str]:
    """The cells of ``schedule``'s row of the printed table."""
    line = next(line for line in out.splitlines() if line.startswith(f"| {schedule} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


LLAMA3_70B_ON_128 = (
    "--preset", "llama3-70b", "--stages", "16", "--microbatches", "32", "--dp", "8",
)  # fmt: skip


@pytest.mark.slow  # three 70B plans of every schedule (~20 s each on an idle core), and the
# largest Llama 3 each fits
def test_a_2bw_plan_for_llama3_70b_fits_80_gb_with_sharded_state_and_checkpointing(capsys):
    """16 stages x 8 replicas of H100s: replicated state does not fit, zero=1 with activation
    checkpointing does, under 2bw; the table names the largest Llama 3 each schedule fits."""
    assert cli(*LLAMA3_70B_ON_128) == 0
    out = capsys.readouterr().out
    assert "zero=0, activation checkpointing off" in out.splitlines()[0]
    assert row(out, "2bw")[6] == "no"
    assert cli(*LLAMA3_70B_ON_128, "--zero", "1", "--activation-checkpointing") == 0
    out = capsys.readouterr().out
    assert "zero=1, activation checkpointing on" in out.splitlines()[0]
    cells = row(out, "2bw")
    assert float(cells[5]) <= 80 and cells[6] == "yes"
    assert cells[7] == "llama3-70b"
    assert cli(*LLAMA3_70B_ON_128, "--zero", "2", "--activation-checkpointing", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["plan"]["zero"], data["plan"]["activation_checkpointing"]) == (2, True)
    two = next(p for p in data["predictions"] if p["schedule"] == "2bw")
    assert max(two["memory_gb"]) <= 80 and two["largest_llama3_that_fits"] == "llama3-70b"


def test_the_largest_llama3_that_fits_is_the_last_of_the_family_under_the_limit():
    p = plan(model=PLANNING_SHAPES["llama3-8b"], stages=16, microbatches=32, dp=8, zero=2,
             activation_checkpointing=True)  # fmt: skip
    peaks = {
        name: estimate(dataclasses.replace(p, model=PLANNING_SHAPES[name]), "2bw").peak_memory_gb
        for name in LLAMA3_FAMILY
    }
    assert peaks["llama3-8b"] < peaks["llama3-70b"] < peaks["llama3-405b"]
    between = (peaks["llama3-70b"] + peaks["llama3-405b"]) / 2
    assert plan_cli.largest_fitting(p, "2bw", between) == "llama3-70b"
    assert plan_cli.largest_fitting(p, "2bw", peaks["llama3-8b"] / 2) == "none"


def test_the_grid_compares_2bw_with_the_fastest_sync_schedule_at_each_shape():
    points = grid(plan(), [2, 4], [1, 2])
    assert [(pt.stages, pt.microbatches) for pt in points] == [(2, 2), (2, 4), (4, 4), (4, 8)]
    for pt in points:
        p = plan(stages=pt.stages, microbatches=pt.microbatches)
        assert pt.async_run == estimate(p, "2bw")
        runnable = {n for n in SYNCHRONOUS_SCHEDULES & set(PIPELINE_SCHEDULES)
                    if shape_problem(p, n) is None}  # fmt: skip
        assert {r.schedule for r in pt.sync_runs} == runnable
        assert ("dualpipev" in runnable) == (pt.microbatches >= 2 * pt.stages)
        assert "zb-v" in runnable
        fastest = max(pt.sync_runs, key=lambda r: r.tokens_per_s)
        assert pt.best_sync == fastest == estimate(p, fastest.schedule)
        fitting = [r for r in pt.sync_runs if r.peak_memory_gb <= pt.async_run.peak_memory_gb]
        assert pt.best_sync_within_memory == (fitting[0] if fitting else None)
        # free messages: 2bw's steady state has no bubble, every flushing schedule has one
        assert pt.async_run.tokens_per_s > pt.best_sync.tokens_per_s
    with pytest.raises(ConfigError, match="8 blocks, too few for P = 16"):
        grid(plan(), [2, 16], [1])


def test_plan_grid_prints_a_row_per_shape_and_draws_it(tmp_path, capsys):
    png = tmp_path / "grid.png"
    args = ("--preset", "small", "--seq-len", "256", "--grid", "2,4", "--grid-ratios", "1,2")
    assert cli(*args, "--png", str(png)) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("| 4 | 8 |")]) == 1
    assert png.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ConfigError, match="--png draws a --grid"):
        cli("--png", str(png))


def test_a_plan_of_sharded_state_without_replicas_is_refused():
    with pytest.raises(ConfigError, match=re.escape(zero_problem(ParallelSettings(zero=1)))):
        plan(zero=1)


def uneven_plan(preset: str, stages: int, gb_per_s: float, microbatches: int) -> ClusterPlan:
    """A planning shape whose stages differ (embedding, head) on a slow link: its steps repeat
    every few microbatches, not every one."""
    return ClusterPlan(
        model=dataclasses.replace(PLANNING_SHAPES[preset], vocab_size=256),
        parallel=ParallelSettings(stages=stages, microbatches=microbatches, dp=2),
        microbatch_size=1, seq_len=512, device=DEVICES["h100"], mfu=0.4,
        p2p=dataclasses.replace(LINKS["ib-hdr"], gb_per_s=gb_per_s),
        allreduce=LINKS["ib-ndr"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "stages", "gb_per_s", "microbatches"),
    [("llama3-8b", 5, 0.5, 150), ("tiny", 4, 0.01, 120)],  # periods of 5 and 1 microbatches
)
def test_many_microbatches_are_extended_exactly_from_a_few_simulated(
    monkeypatch, preset, stages, gb_per_s, microbatches
):
    """Past EXACT_MICROBATCHES the figures come from three simulated shapes one period apart,
    all smaller than M; they are those of simulating every microbatch."""
    p = uneven_plan(preset, stages, gb_per_s, microbatches)
    sizes = []

    def recorded(schedule, stages, microbatches, steps, chunks=None):
        if steps > 1:  # a shape's steps (not the one long step that finds the period)
            sizes.append(microbatches)
        return generate(schedule, stages, microbatches, steps, chunks)

    monkeypatch.setattr(estimate_module, "generate", recorded)
    for name in SCHEDULE_NAMES:
        if shape_problem(p, name):
            continue
        monkeypatch.setattr(estimate_module, "EXACT_MICROBATCHES", 8)
        monkeypatch.setattr(estimate_module, "EXACT_PER_STAGE", 1)
        sizes.clear()
        extended = estimate(p, name)
        assert max(sizes) < microbatches, name
        monkeypatch.setattr(estimate_module, "EXACT_MICROBATCHES", 10**9)
        simulated = estimate(p, name)
        assert extended.step_s == pytest.approx(simulated.step_s, rel=1e-9), name
        assert extended.memory_gb == pytest.approx(simulated.memory_gb, rel=1e-12), name
        assert extended.bubble == pytest.approx(simulated.bubble, rel=1e-9, abs=1e-12), name


def test_ten_million_microbatches_simulate_a_bounded_number(monkeypatch, capsys):
    """`plan --microbatches 10000000` simulates a few thousand microbatches per schedule, not
    the steps' 10**7 (counted, and refused past a budget instead of hanging)."""
    simulated = []

    def counted(schedule, stages, microbatches, steps, chunks=None):
        simulated.append(microbatches * steps)
        if sum(simulated) > 200_000:
            raise AssertionError(f"simulated more than 200,000 microbatches: {simulated}")
        return generate(schedule, stages, microbatches, steps, chunks)

    monkeypatch.setattr(estimate_module, "generate", counted)
    assert cli("--preset", "llama3-8b", "--stages", "4", "--microbatches", "10000000") == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in PIPELINE_SCHEDULES)
    many = estimate(uneven_plan("llama3-8b", 4, 50.0, 10**7), "2bw")
    few = estimate(uneven_plan("llama3-8b", 4, 50.0, 64), "2bw")
    assert many.bubble < few.bubble  # 2bw's fill and drain are paid once per run


def test_a_schedule_that_does_not_settle_names_the_largest_m(monkeypatch):
    monkeypatch.setattr(estimate_module, "STEADY_LIMIT", 8)  # below the first step simulated
    with pytest.raises(ConfigError, match="use --microbatches 160 or fewer"):  # 40 x 4 stages
        estimate(plan(microbatches=1000), "1f1b")


def test_a_shape_no_schedule_can_run_says_so_not_that_none_fits(capsys):
    assert cli("--preset", "tiny", "--stages", "1000") == 1
    out = capsys.readouterr().out
    assert "| schedule |" not in out  # no empty table
    assert out.count("not predicted: ") == len(PIPELINE_SCHEDULES)
    assert out.splitlines()[-1] == (
        "no schedule could be predicted for P=1000, M=16: none can run this shape (each one's "
        "reason is above)"
    )
    assert "fits" not in out


def test_an_unwritable_png_is_refused_before_the_grid_is_computed(tmp_path, capsys):
    png = tmp_path / "missing" / "grid.png"
    with pytest.raises(ConfigError, match=f"--png {png}: folder .* does not exist"):
        cli("--grid", "4", "--png", str(png))
    assert capsys.readouterr().out == ""  # no table first


def test_a_png_that_cannot_be_written_is_refused_before_the_grid_is_computed(
    tmp_path, capsys, unwritable
):
    """Under a regular file, or in a folder that takes no files (``unwritable``: see
    conftest.lock_writes for how read-only is simulated)."""
    (tmp_path / "file").write_text("keep")
    for png in (tmp_path / "file" / "grid.png", unwritable / "grid.png"):
        with pytest.raises(ConfigError, match=re.escape(f"--png {png}: ")):
            cli("--grid", "4", "--png", str(png))
    assert capsys.readouterr().out == ""  # no table first
    assert (tmp_path / "file").read_text() == "keep" and list(unwritable.iterdir()) == []
