"""The schedule and the parallel layout: pipeline stages, chunks, microbatches, data-parallel
replicas, the partition of the model into stages, and the pipeline's messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.config.fields import FREE, LAYOUT, NON_NEGATIVE, POSITIVE, Range, setting

P2P_ROUTES = ("auto", "shared", "per-edge")  # nobubble.pipeline.links
P2P_DTYPES = ("auto", "float32")  # nobubble.pipeline.comm
DIST_BACKENDS = ("auto", "gloo", "nccl")  # nobubble.pipeline.process_group
PARTITIONS = ("blocks", "flops")  # nobubble.model.partition


@dataclass
class ParallelSettings:
    schedule: str = setting("sync", "pipeline schedule (docs/schedules.md)", registry="schedule")
    stages: int = setting(
        1,
        "pipeline stages P (torchrun: one process per stage and replica)",
        POSITIVE,
        resume=LAYOUT,
    )
    chunks: int | None = setting(
        None,
        "model stages per pipeline stage (interleaved-1f1b's virtual stages): the model is cut "
        "into stages x chunks parts, part c·P + r on stage r; default: the schedule's (2 for "
        "interleaved-1f1b, else 1)",
        POSITIVE,
        resume=LAYOUT,
    )
    microbatches: int = setting(1, "microbatches M per optimizer step", POSITIVE)
    dp: int = setting(
        1,
        "data-parallel replicas of the pipeline (torchrun: stages x dp processes); each reads "
        "1/dp of every microbatch",
        POSITIVE,
        resume=LAYOUT,
    )
    tp: int = setting(
        1,
        "tensor-parallel ranks per pipeline stage (torchrun: stages x dp x tp processes, tp "
        "innermost): each stage's attention and MLP matrices split over them (docs/pipeline.md, "
        "'Tensor parallelism inside a stage'); must divide the attention heads, key/value heads "
        "and d_ff",
        POSITIVE,
        resume=LAYOUT,
    )
    zero: int = setting(
        0,
        "sharded data parallelism over a stage's dp replicas (docs/pipeline.md): 0 every replica "
        "holds the whole optimizer and correction state; 1 each holds and updates its part of "
        "it (the gradient all-reduced, the new weights all-gathered); 2 as 1 with a "
        "reduce-scatter, each keeping only its part of the gradient",
        Range(0, 2, high_open=False),
        resume=LAYOUT,
    )
    stage_layers: list[int] | None = setting(
        None,
        "explicit blocks per stage, e.g. [3, 3]",
        NON_NEGATIVE,
        resume=LAYOUT,
    )
    p2p_timeout_s: float = setting(
        300.0,
        "pipeline: fail if a stage waits longer for a peer",
        POSITIVE,
        resume=FREE,
    )
    group_timeout_s: float = setting(
        1800.0,
        "pipeline: the timeout of every process group (the default one, the stage edges', the "
        "replicas', the control plane's): how long a collective, a barrier or a message may "
        "stay pending before the backend aborts it (NCCL's watchdog); above p2p_timeout_s, so "
        "a checkpoint's barrier or a stage's compilation does not abort the run",
        POSITIVE,
        resume=FREE,
    )
    p2p_warmup: bool = setting(
        True,
        "pipeline: connect every stage edge and replica group in one global order before the "
        "first action (NCCL connects a pair on its first send/receive and blocks until the "
        "peer's first; without it most schedules hang at step 0 on NCCL and under "
        "emulate_nccl)",
        resume=FREE,
    )
    p2p_dtype: str = setting(
        "auto",
        "pipeline: the dtype activations and gradients travel between stages in: auto (the "
        "compute dtype: bfloat16 under bfloat16 autocast, half the bytes, float32 otherwise) | "
        "float32 (as the stages hold them: a bfloat16 run then equals the one-process engine's "
        "float32 hand-offs)",
        choices=P2P_DTYPES,
        resume=FREE,
    )
    p2p_routes: str = setting(
        "auto",
        "pipeline: process groups of the messages: shared (one group; gloo only: it pairs by "
        "tag; under emulate_nccl it hangs as NCCL would) | per-edge (one per stage edge and "
        "channel, control on gloo: what NCCL needs) | auto (shared on gloo, per-edge on NCCL "
        "and under emulate_nccl)",
        choices=P2P_ROUTES,
        resume=FREE,
    )
    dist_backend: str = setting(
        "auto",
        "pipeline: the torch.distributed backend: auto (nccl on CUDA, gloo on the CPU) | gloo "
        "(also with CUDA tensors, through host memory: several processes may share one GPU) | "
        "nccl (one GPU per process)",
        choices=DIST_BACKENDS,
        resume=FREE,
    )
    emulate_nccl: bool = setting(
        False,
        "pipeline, gloo only: run the messages and collectives as NCCL would (tags ignored, "
        "one operation at a time per process group, in posting order), so a schedule that "
        "would hang on NCCL hangs here too and says where; the same results as without",
        resume=FREE,
    )
    partition: str = setting(
        "flops",
        "how the blocks are split over the model stages when stage_layers is not given: flops "
        "(each part by its training FLOPs; of the splits with the same slowest stage the most "
        "even, lighter at the front; resolved into stage_layers once the tokenizer is known and "
        "saved in config.json) or blocks (the embedding and the head weigh embed_cost and "
        "head_cost blocks; of those splits the one filled from the front, as every run saved "
        "without this key was split)",
        choices=PARTITIONS,
        resume=LAYOUT,
        saved_default="blocks",
    )
    embed_cost: float = setting(
        1.0, "partition weight of the embedding, in blocks", NON_NEGATIVE, resume=LAYOUT
    )
    head_cost: float = setting(
        1.0,
        "partition weight of the final norm + head, in blocks",
        NON_NEGATIVE,
        resume=LAYOUT,
    )
