"""GPU catalog: the total memory each device's driver reports, with where it comes from.

Planning divides `total * gpu_memory_utilization`, and the engine reads the total from
the CUDA driver (`cudaMemGetInfo`; ROCm's on AMD), which is less than the marketed size
and less than `nvidia-smi`'s memory.total (that includes what the driver reserves and
CUDA never offers: 616 MiB on the H200, where nvidia-smi says 143771MiB).

A figure marked `measured` was read off a real device. Where a source gives CUDA's own
total (torch.cuda.mem_get_info, vLLM's `total_memory=` / `total_gpu_memory`, torch's
out-of-memory message "GPU 0 has a total capacity of X GiB", cudaDeviceProp's total
global memory), that is the figure, to the 0.01 GiB the source prints; the source is
quoted in each entry. The same part prints totals a few hundredths of a GiB apart under
different drivers (L4: 22.03-22.05 GiB), which is the precision of these figures. Where
no such source was found the entry says so and keeps nvidia-smi's figure (which
overstates CUDA's total by about 0.4-1%) or the vendor's capacity in decimal GB (which
overstates it by a few GiB). Pass the exact size (`--gpu-memory`) where it matters.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GpuModel:
    name: str  # the catalog key, e.g. "H100-80GB"
    total_memory_bytes: int
    measured: bool  # True: the driver's own figure; False: vendor capacity
    source: str
    aliases: tuple[str, ...] = ()
    arch: str = ""  # "ampere", "ada", "hopper", "blackwell", "cdna": picks vLLM kernels
    # The part has no NVLink at all, so GPUs of it talk over PCIe only. vLLM turns
    # custom all-reduce off on more than two same-node GPUs unless NVML reports NVLink
    # P2P between every pair (custom_all_reduce.py and platforms/cuda.py
    # `is_fully_connected`, the same in 0.32-0.34; 0.19 logs the same WARNING), which
    # on such a part is every TP > 2: kvplan then plans the TP 1 non-torch figure
    # (profiling.py `non_torch_bytes`). False where a part has NVLink (SXM boards, or
    # bridges as on the H100 NVL and RTX 3090) or is not NVIDIA's.
    pcie_only: bool = False
    # Streaming multiprocessors, torch's `multi_processor_count` (NVIDIA's published
    # figure for the part; 0 = not listed). vLLM 0.17-0.19's Triton top-k/top-p kernel
    # sizes its cached row buffer by it (topk_topp_triton.py
    # `apply_top_k_top_p_triton`, through `current_platform.num_compute_units`), so
    # the sampler's activation term depends on the part (profiling.py
    # `triton_row_buffer_bytes`).
    sm_count: int = 0


CATALOG: tuple[GpuModel, ...] = (
    GpuModel(
        "A100-40GB",
        int(39.50 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on an A100 40GB, '39.50 GiB' (to "
        "0.01 GiB): github.com/TianheWu/CoSeR/issues/10; nvidia-smi says 40960MiB",
        aliases=("A100-40G", "A100-SXM4-40GB"),
        arch="ampere",
        sm_count=108,
    ),
    GpuModel(
        "A100-80GB",
        int(79.25 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on A100 80GB, '79.25 GiB' (to "
        "0.01 GiB): github.com/levihsu/OOTDiffusion/issues/235, "
        "github.com/HiDream-ai/VAREdit/issues/6; nvidia-smi says 81920MiB",
        aliases=("A100", "A100-SXM4-80GB", "A800-80GB"),
        arch="ampere",
        sm_count=108,
    ),
    GpuModel(
        "H100-80GB",
        int(79.19 * GIB),
        True,
        "CUDA's total as vLLM's worker logs it on H100 80GB HBM3, 'total_memory=79.19GiB' "
        "(to 0.01 GiB): github.com/llm-d-incubation/llm-d-planner, accuracy/results/"
        "v0.19.0/logs; nvidia-smi says 81559MiB (the driver's reservation included)",
        aliases=("H100", "H100-SXM", "H100-SXM-80GB", "H100-PCIE-80GB", "H800-80GB"),
        arch="hopper",
        # the SXM part; the H100 PCIe alias has 114 (18 rows fewer in the 0.17-0.19
        # sampler buffer: 11 MB at a 152K vocabulary)
        sm_count=132,
    ),
    GpuModel(
        "H100-NVL-94GB",
        int(93.09 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on an H100 NVL, 'GPU 0 has a total "
        "capacity of 93.09 GiB' (a public report found by the code index; other 94 GB "
        "Hopper reports print 93.10); nvidia-smi on 'NVIDIA H100 NVL' says 95830MiB",
        aliases=("H100-NVL", "H100-94GB"),
        arch="hopper",
        sm_count=132,
    ),
    GpuModel(
        "H200-141GB",
        150_109_880_320,
        True,
        "torch.cuda.mem_get_info on 'NVIDIA H200', driver 580.159.04 (docs/gpu-check.md): "
        "150,109,880,320 B; nvidia-smi: 143771MiB, 616 MiB of it reserved by the driver",
        aliases=("H200",),
        arch="hopper",
        sm_count=132,
    ),
    GpuModel(
        "H20-96GB",
        97_871 * MIB,
        False,
        "vendor capacity 96 GB HBM3; figure taken as the 96 GB Hopper boards' 97871MiB "
        "(seen on GH200), not read off an H20; no CUDA total found (nvidia-smi's figure)",
        aliases=("H20",),
        arch="hopper",
        sm_count=78,
    ),
    GpuModel(
        "GH200-96GB",
        97_871 * MIB,
        True,
        "nvidia-smi on GH200 (900 W board, 96 GB HBM3): 97871MiB; no CUDA total found, so "
        "this overstates it by the driver's reservation",
        aliases=("GH200",),
        arch="hopper",
        sm_count=132,
    ),
    GpuModel(
        "B200-180GB",
        int(178.35 * GIB),
        True,
        "CUDA's total on 'NVIDIA B200': cudaDeviceProp's 'Total Global Memory: 178.35 GB' "
        "(GiB, labelled GB: github.com/pytorch/ao/pull/4002) and torch's OOM message 'GPU 0 "
        "has a total capacity of 178.35 GiB' in several public B200 reports; nvidia-smi "
        "says 183359MiB",
        aliases=("B200",),
        arch="blackwell",
        sm_count=148,
    ),
    GpuModel(
        "B300-288GB",
        288 * GB,
        False,
        "vendor capacity 288 GB HBM3e (NVIDIA B300 SXM6); driver figure not verified",
        aliases=("B300",),
        arch="blackwell",
    ),
    GpuModel(
        "L40S-48GB",
        int(44.39 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on an L40S during vLLM's CUDA-graph "
        "capture, 'GPU 0 has a total capacity of 44.39 GiB' (public deploy notes found by "
        "the code index; an AWS g6e L40S report gives 44.4 GiB); nvidia-smi says 46068MiB",
        aliases=("L40S",),
        arch="ada",
        pcie_only=True,
        sm_count=142,
    ),
    GpuModel(
        "L4-24GB",
        int(22.05 * GIB),
        True,
        "CUDA's total on the L4 vLLM's CI runs on, torch's OOM message 'GPU 0 has a total "
        "capacity of 22.05 GiB' (github.com/vllm-project/vllm/issues/20214); other L4s "
        "print 22.03-22.04 GiB; nvidia-smi says 23034MiB",
        aliases=("L4",),
        arch="ada",
        pcie_only=True,
        sm_count=58,
    ),
    GpuModel(
        "A10G-24GB",
        int(22.06 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on AWS g5 (A10G), 'GPU 0 has a "
        "total capacity of 22.06 GiB', also under vLLM after 'Model loading took 16.48 "
        "GiB' (public reports found by the code index); nvidia-smi says 23028MiB "
        "(github.com/modal-labs/modal-client/pull/2797)",
        aliases=("A10G", "A10G-24G"),
        arch="ampere",
        pcie_only=True,
        sm_count=80,
    ),
    GpuModel(
        "RTX-4090-24GB",
        int(23.52 * GIB),
        True,
        "CUDA's total as torch's OOM message prints it on 'NVIDIA GeForce RTX 4090, 24564 "
        "MiB' (nvidia-smi, driver 595.84): 'GPU 0 has a total capacity of 23.52 GiB' (a "
        "public report found by the code index); an older driver printed 23.68 GiB "
        "(github.com/zai-org/CogVideo/issues/36)",
        aliases=("RTX-4090", "RTX4090"),
        arch="ada",
        pcie_only=True,
        sm_count=128,
    ),
    GpuModel(
        "RTX-3090-24GB",
        int(23.58 * GIB),
        True,
        "CUDA's total as vLLM's V0 worker logs it on an RTX 3090, 'total_gpu_memory=23.58GiB' "
        "(github.com/vllm-project/vllm/issues/10517, the calibration set's V0 records); "
        "nvidia-smi says 24576MiB",
        aliases=("RTX-3090", "RTX3090"),
        arch="ampere",
        sm_count=82,
    ),
    GpuModel(
        "MI300X-192GB",
        205_822_885_888,
        True,
        "rocm-smi --showmeminfo vram on 'AMD Instinct MI300X': 205822885888 B (191.69 GiB), "
        "which torch's HIP OOM message prints on some MI300X hosts; others print 191.98 GiB, "
        "so the figure is good to 0.3 GiB",
        aliases=("MI300X",),
        arch="cdna",
    ),
    GpuModel(
        "MI325X-256GB",
        256 * GB,
        False,
        "vendor capacity 256 GB HBM3E (AMD Instinct MI325X); driver figure not verified",
        aliases=("MI325X",),
        arch="cdna",
    ),
    GpuModel(
        "MI355X-288GB",
        288 * GB,
        False,
        "vendor capacity 288 GB HBM3E (AMD Instinct MI355X); driver figure not verified",
        aliases=("MI355X",),
        arch="cdna",
    ),
)

_BY_NAME: dict[str, GpuModel] = {}
for _gpu in CATALOG:
    for _key in (_gpu.name, *_gpu.aliases):
        _BY_NAME[_key.lower()] = _gpu

# Name -> total bytes for DeviceRef.name (request files, static inventory, leases):
# every catalog name and alias with its one catalog figure, so a GPU name means the
# same size on every path (the model commands send the same figure as
# total_memory_bytes). "H100-94GB" is the NVL part's historical name, an alias.
GPU_MEMORY_BYTES: dict[str, int] = {
    key: gpu.total_memory_bytes for gpu in CATALOG for key in (gpu.name, *gpu.aliases)
}


class UnknownGpu(KeyError):
    pass


def lookup_gpu(name: str) -> GpuModel:
    """The catalog entry for `name` (case-insensitive; aliases accepted)."""
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        known = ", ".join(gpu.name for gpu in CATALOG)
        raise UnknownGpu(f"unknown GPU {name!r}; known: {known} (or give --gpu-memory)") from None
