import dataclasses

import pytest
import torch

from nobubble.config import ConfigError, TrainConfig
from nobubble.configure import build_config
from nobubble.model.layers import Stage, apply_rope, build_model, lm_loss, rope_tables
from nobubble.model.partition import (
    StageSpec,
    flop_costs,
    partition,
    resolve_partition,
    stage_specs,
)
from nobubble.model.presets import PRESETS
from nobubble.model.resolve import model_config


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_smollm2_135m_has_the_published_parameter_count():
    mc = model_config(TrainConfig(preset="smollm2-135m", tokenizer="byte"), tokenizer_vocab=257)
    with torch.device("meta"):
        model = Stage(mc, StageSpec(0, range(mc.n_layers), True, True))
    # 49152*576 tied embedding + 30 * (attention 884,736 + MLP 2,654,208 + 2 norms) + final norm
    assert n_params(model) == 134_515_008


def test_smollm2_360m_shape():
    mc = PRESETS["smollm2-360m"]
    assert (mc.d_model, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.d_ff) == (960, 32, 15, 5, 2560)
    assert mc.vocab_size == 49152 and mc.tie_embeddings and mc.rope_theta == 1e5


def test_vocabulary_comes_from_the_tokenizer_rounded_up():
    mc = model_config(TrainConfig(), tokenizer_vocab=257)
    assert mc.vocab_size == 320


def test_tokenizer_larger_than_preset_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="vocabulary"):
        model_config(TrainConfig(preset="smollm2-135m"), tokenizer_vocab=50000)


def test_sequence_longer_than_the_model_is_refused():
    with pytest.raises(ConfigError, match="max_seq_len"):
        model_config(TrainConfig(seq_len=4096), tokenizer_vocab=257)


def test_bad_head_counts_are_refused():
    with pytest.raises(ConfigError, match="divisible"):
        model_config(TrainConfig(n_heads=3), tokenizer_vocab=257)


def test_rotary_tables_follow_the_sequences_run_not_max_seq_len(tiny_mc):
    """A model of max_seq_len 10**6 makes its tables for the sequences it runs (not a million
    rows up front: 10**9 would be gigabytes), with the very rows a table of any length has."""
    mc = dataclasses.replace(tiny_mc, max_seq_len=10**6)
    stage = Stage(mc, StageSpec(0, range(mc.n_layers), True, True))
    assert stage.rope_cos.numel() == 0
    x = torch.randint(0, mc.vocab_size, (2, 8))
    out = stage(x)
    assert stage.rope_cos.shape == (8, mc.head_dim // 2)
    cos, sin = rope_tables(mc.head_dim, 64, mc.rope_theta)
    assert torch.equal(stage.rope(5)[0], cos[:5]) and torch.equal(stage.rope(5)[1], sin[:5])
    assert stage.rope_cos.shape[0] == 8  # shorter sequences reuse the tables
    stage.rope(16)
    assert torch.equal(stage.rope_cos, cos[:16]) and torch.equal(stage(x), out)


def test_stages_run_in_sequence_equal_the_full_model(tiny_mc):
    full = build_model(tiny_mc, seed=3)
    specs = partition(tiny_mc.n_layers, 3)
    stages = [Stage(tiny_mc, spec, seed=3) for spec in specs]
    full_params = dict(full.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_params[name]), name
    x = torch.randint(0, tiny_mc.vocab_size, (2, 16))
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)


def test_parameter_names_are_stable_across_partitions(tiny_mc):
    names = set(dict(build_model(tiny_mc).named_parameters()))
    staged = set()
    for spec in partition(tiny_mc.n_layers, 2, stage_layers=[1, 3]):
        staged |= set(dict(Stage(tiny_mc, spec).named_parameters()))
    assert staged == names
    assert "blocks.3.attn.wq.weight" in names and "head.weight" in names


def test_model_is_causal(tiny_mc):
    model = build_model(tiny_mc)
    x = torch.randint(0, tiny_mc.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % tiny_mc.vocab_size
    torch.testing.assert_close(model(x)[0, :8], model(y)[0, :8])


def test_tied_embeddings_share_one_tensor(tiny_mc):
    model = build_model(dataclasses.replace(tiny_mc, tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    assert "head.weight" not in dict(model.named_parameters())


def test_split_tied_embeddings_put_a_copy_on_the_last_stage(tiny_mc):
    """Split over stages, the last stage's head uses its own copy of the tied weight, under the
    embedding's name and with its initial bytes."""
    mc = dataclasses.replace(tiny_mc, tie_embeddings=True)
    first = Stage(mc, StageSpec(0, range(0, 2), True, False))
    last = Stage(mc, StageSpec(1, range(2, 4), False, True))
    assert last.head.weight is last.embed.weight
    assert "head.weight" not in dict(last.named_parameters())
    assert torch.equal(last.embed.weight, first.embed.weight)
    assert torch.equal(last.embed.weight, build_model(mc).embed.weight)
    hidden = torch.randn(1, 8, mc.d_model)
    assert last(hidden).shape == (1, 8, mc.vocab_size)  # hidden states in, not token ids


def test_rope_preserves_norm_and_relative_positions():
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, 0, 3:] * rk[0, 0, :-3]).sum(-1)  # same offset 3 everywhere
    torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-4, atol=1e-5)


def test_loss_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 5, 64)
    targets = torch.randint(0, 64, (2, 5))
    assert lm_loss(logits, targets).item() == pytest.approx(torch.log(torch.tensor(64.0)).item())


@pytest.mark.parametrize(
    ("layers", "stages", "embed", "head", "expected"),
    [
        (4, 1, 1.0, 1.0, [4]),
        (4, 2, 1.0, 1.0, [2, 2]),
        (30, 4, 1.0, 1.0, [7, 8, 8, 7]),
        (8, 3, 2.0, 3.0, [3, 5, 0]),
        (6, 2, 0.0, 4.0, [5, 1]),
    ],
)
def test_balanced_partition(layers, stages, embed, head, expected):
    specs = partition(layers, stages, embed, head)
    assert [len(s.blocks) for s in specs] == expected
    assert specs[0].has_embed and specs[-1].has_head
    assert [b for s in specs for b in s.blocks] == list(range(layers))


@pytest.mark.parametrize(
    ("layers", "stages", "embed", "head", "expected"),
    [
        # the slowest stage costs 2 either way: costs 1, 1, 2, 2 (sum of squares 10) tie with
        # blocks' 2, 2, 1, 1; the lighter front wins
        (4, 4, 1.0, 1.0, [0, 1, 2, 1]),
        # slowest 3: blocks' 2, 3, 3, 0 (costs 3, 3, 3, 1: 28) against 3, 2, 3, 3 (26)
        # and lighter at the front of the splits of 26
        (8, 4, 1.0, 1.0, [1, 2, 3, 2]),
        (12, 4, 1.0, 1.0, [2, 3, 4, 3]),
        # the shape: blocks gives 5, 6 x 12, 2, 1, 0; costs 82 over 16 stages at most 6
        # each, the most even has fourteen 5s and two 6s, the 6s at the back
        (80, 16, 1.0, 1.0, [4] + [5] * 13 + [6, 5]),
        # Llama 3 70B's head by its FLOPs (about 1.14 blocks): the last stage takes 4 blocks
        # (5.14), one 6 among 5s, at the back
        (80, 16, 0.0, 1.14, [5] * 14 + [6, 4]),
        (4, 1, 1.0, 1.0, [4]),
        (1, 3, 1.0, 1.0, [0, 1, 0]),
    ],
)
def test_even_partition_prefers_the_most_even_split_lighter_at_the_front(
    layers, stages, embed, head, expected
):
    specs = partition(layers, stages, embed, head, even=True)
    assert [len(s.blocks) for s in specs] == expected
    assert [b for s in specs for b in s.blocks] == list(range(layers))
    fastest = partition(layers, stages, embed, head)  # the same slowest stage

    def slowest(counts: list[int]) -> float:
        return max(n + embed * (i == 0) + head * (i == stages - 1) for i, n in enumerate(counts))

    assert slowest(expected) == slowest([len(s.blocks) for s in fastest])


def test_partition_blocks_splits_as_recorded_runs_did():
    """partition=blocks (every run folder and study recorded without a partition key or
    stage_layers: tests/test_config.py) keeps its split, stages filled from the front."""
    assert [len(s.blocks) for s in partition(80, 16)] == [5] + [6] * 12 + [2, 1, 0]
    assert [len(s.blocks) for s in partition(4, 4)] == [1, 2, 1, 0]  # tiny on 4 stages


def test_explicit_partition_and_its_errors():
    assert [len(s.blocks) for s in partition(4, 2, stage_layers=[1, 3])] == [1, 3]
    with pytest.raises(ConfigError, match="summing"):
        partition(4, 2, stage_layers=[1, 2])
    with pytest.raises(ConfigError, match="no block"):
        partition(4, 3, stage_layers=[2, 0, 2])
    with pytest.raises(ConfigError, match="at most"):
        partition(2, 5)


def test_too_many_stages_name_the_most_the_blocks_can_fill():
    """Every stage but the first and the last needs a block: n blocks fill n + 2 stages."""
    assert [len(s.blocks) for s in partition(1, 3)] == [0, 1, 0]
    with pytest.raises(ConfigError, match=r"cannot split 1 blocks over 4 stages: .* at most 3 "):
        partition(1, 4)


def test_interleaving_says_its_stages_are_stages_times_chunks():
    settings = {"schedule": "interleaved-1f1b", "stages": 2, "microbatches": 2, "n_layers": 1}
    with pytest.raises(ConfigError) as refused:
        build_config(settings)
    assert str(refused.value) == (
        "interleaved-1f1b cuts the model into stages x chunks = 2 x 2 = 4 stages, and cannot "
        "split 1 blocks over 4 stages: every stage but the first and the last needs a block, so "
        "at most 3 stages; use fewer stages or more blocks (n_layers), or fewer chunks"
    )


def test_vocab_size_and_norm_eps_override_the_preset_and_a_too_small_vocabulary_is_refused():
    mc = model_config(build_config({"vocab_size": 384, "norm_eps": 1e-6}), tokenizer_vocab=257)
    assert (mc.vocab_size, mc.norm_eps) == (384, 1e-6)
    with pytest.raises(ConfigError, match=r"vocab_size gives a vocabulary of 200 .* 257 tokens"):
        model_config(build_config({"vocab_size": 200}), tokenizer_vocab=257)


FLOPS_SHAPE = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "n_layers": 4}


def test_flop_costs_by_hand():
    """A block: 2·64·16·(4+2) + 3·64·128 = 36,864 matmul weights, 4·4·16·32 = 8,192 attention
    FLOPs per token forward: 3·(2·36,864 + 8,192) = 245,760 per token trained; the head
    6·64·1000 = 384,000, 1.5625 blocks; the lookup none."""
    cfg = build_config({**FLOPS_SHAPE, "vocab_size": 1000, "seq_len": 32})
    assert flop_costs(model_config(cfg, tokenizer_vocab=1000), seq_len=32) == (0.0, 1.5625)


def test_partition_flops_resolves_into_stage_layers_and_blocks_stays_a_rule():
    settings = {**FLOPS_SHAPE, "vocab_size": 1000, "seq_len": 32, "stages": 2}
    settings |= {"schedule": "2bw", "microbatches": 2, "batch_size": 2}
    blocks = build_config({**settings, "partition": "blocks"})
    mc = model_config(blocks, tokenizer_vocab=1000)
    assert resolve_partition(blocks, mc) is blocks  # the rule of earlier runs: nothing to resolve
    assert [len(s.blocks) for s in partition(4, 2)] == [2, 2]  # embed, head: a block each
    flops = build_config(settings)  # the default
    # stage 0: n blocks; stage 1: 4 - n blocks and the head's 1.5625: n = 3 gives max(3, 2.56)
    assert resolve_partition(flops, mc).stage_layers == [3, 1]
    given = build_config({**settings, "partition": "flops", "stage_layers": [1, 3]})
    assert resolve_partition(given, mc) is given  # an explicit split wins


def test_the_default_partition_splits_80_blocks_on_16_stages_evenly_lighter_at_the_front():
    """The issue's shape, Llama 3 70B on 16 stages: the default (partition=flops) takes the
    most even of the splits with the fewest FLOPs on the slowest stage, not partition=blocks'
    5, 6 x 12, 2, 1, 0 (the first stages, which hold the most activations, full), and a new
    run saves that split."""
    shape = {"d_model": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "d_ff": 28672}
    settings = {**shape, "seq_len": 2048, "max_seq_len": 8192, "stages": 16}
    settings |= {"schedule": "2bw", "microbatches": 16, "batch_size": 16}
    cfg = build_config(settings)
    mc = model_config(cfg, tokenizer_vocab=128256)
    even = [5] * 14 + [6, 4]
    assert cfg.partition == "flops"
    assert [len(s.blocks) for s in stage_specs(cfg, mc)] == even
    assert resolve_partition(cfg, mc).stage_layers == even
    blocks = build_config({**settings, "partition": "blocks"})
    assert [len(s.blocks) for s in stage_specs(blocks, mc)] == [5] + [6] * 12 + [2, 1, 0]
