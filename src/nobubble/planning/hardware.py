"""Device and link figures the cost model starts from; every one can be overridden on the
command line, and each default says where it comes from."""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.model.flops import PEAK_BF16_TFLOPS


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense BF16
    memory_gb: float
    node_link: str  # the link between the GPUs of one node (a key of LINKS)


@dataclass(frozen=True)
class Link:
    name: str
    gb_per_s: float  # one direction, bytes
    latency_us: float


def _peak(name: str) -> float:
    return next(tflops for _, table_name, tflops in PEAK_BF16_TFLOPS if table_name == name)


# Peaks: nobubble.model.flops' datasheet table (dense BF16). Memory and the node's link: NVIDIA's
# datasheets (H100 and H200 SXM: NVLink 900 GB/s; A100 80GB SXM: NVLink 600 GB/s).
DEVICES = {
    "h100": Device("H100 SXM", _peak("H100 SXM"), 80.0, "nvlink4"),
    "h200": Device("H200 SXM", _peak("H200 SXM"), 141.0, "nvlink4"),
    "a100": Device("A100 80GB", _peak("A100"), 80.0, "nvlink3"),
}

# Bandwidths: NVLink 4 on H100 SXM is 900 GB/s in total, 450 GB/s each way (NVIDIA H100 Tensor
# Core GPU datasheet; the same for H200 SXM); NVLink 3 (A100 SXM) 600 GB/s, 300 each way (NVIDIA
# A100 datasheet); InfiniBand NDR and HDR ports carry 400 and 200 Gb/s (50 and 25 GB/s).
# Latencies are assumed round figures (a few microseconds per message), not measurements.
LINKS = {
    "nvlink4": Link("NVLink 4", 450.0, 2.0),
    "nvlink3": Link("NVLink 3", 300.0, 2.0),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s", 50.0, 5.0),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s", 25.0, 5.0),
}
