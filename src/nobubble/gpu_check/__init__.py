"""``nobubble gpu-check``, the CPU side of ``scripts/gpu_check.sh``: which runs to do on a machine
with N GPUs, how each compares with its one-process reference, and the table of them all.

Every run trains SmolLM2-360M's shape for a few steps on short sequences in bfloat16. A row is a
pipeline under torchrun: with one GPU its processes share the GPU over gloo under the NCCL
emulator, with two or more GPUs they run on NCCL, a GPU each. Each row is compared with a
one-process run of the same semantics (:mod:`~nobubble.gpu_check.plan`); a smoke test comes
first, one row measures throughput, one audits a step's synchronizations
(:mod:`~nobubble.gpu_check.audit`). Each run has a timeout of its own; past it the Python stacks
of its every process are dumped into its log (:mod:`~nobubble.gpu_check.row`). Then
:mod:`~nobubble.gpu_check.parity` compares a run with its reference and
:mod:`~nobubble.gpu_check.table` makes the table (printed, and as JSON).

    nobubble gpu-check plan --gpus N --out OUT   # OUT/plan.json; a run a line
    nobubble gpu-check row OUT NAME              # run NAME, within its timeout
    nobubble gpu-check compare OUT NAME          # OUT/parity/NAME.json
    nobubble gpu-check table OUT                 # the table, OUT/table.json
"""
