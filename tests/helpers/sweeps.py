"""A sweep small enough to run in a test: two schedules of a tiny model, four steps each."""

TOY_GRID = """
[sweep]
name = "toy"

[base]
d_model = 32
n_layers = 2
n_heads = 2
n_kv_heads = 1
d_ff = 64
seq_len = 32
batch_size = 4
steps = 4
eval_every = 2
checkpoint_every = 2
eval_batches = 1
warmup_steps = 1

[grid]
schedule = ["sync", "2bw"]
"""
