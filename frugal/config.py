"""Engine configuration: frozen dataclasses composed into one EngineConfig.

Validation raises ValueError naming the offending field; nothing here touches tensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from frugal.model_config import ModelConfig, MoeConfig  # noqa: F401 (re-exported)

DUMMY_INITS = ("uniform", "normal")  # how --load-format dummy draws weights (loader.dummy)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# Quantized KV cache formats: name -> (K's dtype, V's dtype; None: the activations'), and
# whether each row carries its own scale (ops.torch_ref.kv_quant) rather than one static scale a
# layer and KV head. Names follow vLLM's where it has them.
KV_FORMATS = {
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn, False),
    "fp8_per_token_head": (torch.float8_e4m3fn, torch.float8_e4m3fn, True),
    "int8_per_token_head": (torch.int8, torch.int8, True),
    "fp8_v": (None, torch.float8_e4m3fn, True),
}
KV_ALIASES = {"fp8": "fp8_e4m3", "int8_per_token": "int8_per_token_head"}
KV_DTYPES = {**DTYPES, **{name: fmt[1] for name, fmt in KV_FORMATS.items()},
             **{alias: KV_FORMATS[name][1] for alias, name in KV_ALIASES.items()}}


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6,
          "MIB": 2**20, "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12,
          "TIB": 2**40}


def parse_memory(value: str | int | float, field_name: str = "kv_cache_memory") -> int | float:
    """'4GiB' / '512MB' / 1073741824 -> bytes (int); a number in (0, 1] -> a fraction (float)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"{field_name}: cannot parse {value!r} "
                             "(use e.g. 2GiB, 512MiB, or 0.3)")
        number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if number <= 0:
        raise ValueError(f"{field_name}: must be positive, got {value!r}")
    if not unit and number <= 1.0:
        return number
    if unit not in _UNITS:
        raise ValueError(f"{field_name}: unknown unit in {value!r}")
    return int(number * _UNITS[unit])


def available_memory_bytes(device: str) -> int:
    """Memory a KV budget fraction refers to: free device memory (CUDA) or available RAM (CPU)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


QUANTIZATIONS = ("none", "int4", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: pages of page_size tokens.

    The pool takes kv_cache_memory when given (bytes, or a fraction of free memory). Otherwise,
    on a GPU, it takes what is left of gpu_memory_utilization x total memory after the weights,
    the peak activations of a profiled step and the CUDA graphs; on the CPU, 2 GiB.

    kv_cache_dtype fp8_e4m3 (alias fp8) stores K and V as FP8 with a scale per layer, KV head
    and K/V, taken from the checkpoint, else from kv_scales_path (`frugal calibrate-kv`), else
    calibrated at start-up on built-in texts (or on calibration_file). fp8_per_token_head and
    int8_per_token_head (alias int8_per_token) store each token and head's row with its own
    scale (nothing calibrated); fp8_v keeps K in the activation dtype and V as such FP8 rows.
    Any quantized format is checked at start-up against a cache in the activation dtype (KL of
    the next-token distribution on built-in texts, worker.kv_check); kv_cache_max_kl refuses
    to start above that KL; kv_cache_check False skips the check (a deployment that measured
    its model and format already).

    kv_integrity: before every step, check on the device that each request's pages still carry
    the tags they had when it got them, and abort only the requests whose pages do not.

    enable_prefix_caching: full pages are kept, named by a hash of the tokens up to their end,
    and shared by later requests that start with the same tokens (see core.prefix_cache).
    """

    page_size: int = 16
    kv_cache_memory: int | float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    kv_scales_path: str | None = None
    calibration_file: str | None = None
    kv_cache_max_kl: float | None = None
    kv_cache_check: bool = True
    kv_integrity: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: must be a power of two, got {self.page_size}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_memory(self.kv_cache_memory))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_cache_dtype: unsupported {self.kv_cache_dtype!r} "
                             f"(auto, {', '.join(KV_DTYPES)})")
        if self.kv_cache_dtype in KV_ALIASES:
            object.__setattr__(self, "kv_cache_dtype", KV_ALIASES[self.kv_cache_dtype])
        if self.kv_cache_max_kl is not None and not (
                self.quantized and self.kv_cache_max_kl >= 0):
            raise ValueError("kv_cache_max_kl: a KL >= 0, with a quantized kv_cache_dtype "
                             f"({', '.join(KV_FORMATS)})")
        if self.kv_cache_max_kl is not None and not self.kv_cache_check:
            raise ValueError("kv_cache_max_kl: needs the start-up check (kv_cache_check)")
        if not self.fp8 and (self.kv_scales_path or self.calibration_file):
            raise ValueError("kv_scales_path / calibration_file: only with kv_cache_dtype "
                             "fp8_e4m3")

    @property
    def fp8(self) -> bool:
        """FP8 with static scales (calibrated, loaded or from the checkpoint)."""
        return self.kv_cache_dtype == "fp8_e4m3"

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype in KV_FORMATS


BIG_GPU_BYTES = 70 << 30  # a GPU with this much memory or more gets the larger step budget


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. max_model_len None means the model's context length."""

    max_num_seqs: int = 256
    # tokens of one step (prompt chunks + decodes); None: 8192 on a GPU of 70 GiB or more, else
    # 2048, as vLLM's server takes (EngineConfig.resolved_batched_tokens)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs. model None means the bundled default model."""

    model: str | None = None
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    dummy_init: str = "uniform"  # dummy weights: uniform (vLLM's) | normal (loader.dummy)
    dtype: str = "auto"
    device: str = "auto"
    ops_backend: str = "auto"  # auto: triton on CUDA, torch_ref on CPU
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    cuda_graph_max_bs: int = 256  # largest decode batch replayed from a graph
    # steps with prompt tokens up to this many tokens replayed from graphs (worker.prompt_graphs;
    # 0: none; with decode graphs only, and not for DSA)
    prompt_graph_max_tokens: int = 2048
    # shared experts stacked with the routed ones where they fit (layers.moe.MoE.fuse_shared)
    shared_experts_fusion: bool = True
    overlap_schedule: bool = True  # launch the next step before reading this one's tokens
    seed: int = 0
    # none | int4 (W4A16) | fp8 (W8A8: per-channel weights, activations per token): a
    # checkpoint's own quantized weights are kept as they are (GGUF Q4_0/Q4_1 too), the rest
    # rounded to nearest
    quantization: str = "none"
    num_layers: int | None = None  # run only the model's first N decoder layers
    # processes (GPUs) a model is split across (frugal.parallel; engine.worker)
    tensor_parallel_size: int = 1
    # prefill/decode disaggregation (frugal.disagg): None, or "prefill", "decode", "both" (a
    # NIXL agent over the KV pool; requests' kv_transfer_params say what each one does)
    kv_role: str | None = None
    kv_lease_s: float = 120.0  # a prefill's pages wait this long for the decode side's read
    kv_transfer_timeout_s: float = 30.0  # a decode worker's read of a prompt's KV
    # the deployment's shared secret (disagg.signing): hand-offs signed and verified with it
    kv_secret: str | None = field(default=None, repr=False)
    kv_address: tuple[str, int] | None = None  # where decode workers reach this worker
    kv_max_held_fraction: float = 0.5  # of the pool, held for decode workers at most
    # a decode worker refuses hand-offs from a peer whose probe read (disagg.probe) went over
    # TCP or through host memory
    kv_require_fast_path: bool = False
    # "auto": a peer on this host whose pool maps here (CUDA IPC, a CPU pool's memory file) is
    # read by this worker's own page copy (disagg.direct), any other over NIXL; "nixl": NIXL
    kv_transport: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ValueError(f"load_format: unsupported {self.load_format!r} "
                             "(auto, gguf, safetensors, dummy)")
        if self.dummy_init not in DUMMY_INITS:
            raise ValueError(f"dummy_init: unsupported {self.dummy_init!r} "
                             f"({', '.join(DUMMY_INITS)})")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {self.dtype!r} ({', '.join(DTYPES)})")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device: unsupported {self.device!r} (auto, cpu, cuda)")
        if self.ops_backend not in ("auto", "torch_ref", "triton"):
            raise ValueError(f"ops_backend: unsupported {self.ops_backend!r} "
                             "(auto, torch_ref, triton)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: unsupported {self.quantization!r} "
                             f"({', '.join(QUANTIZATIONS)})")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kv_role is not None:
            raise ValueError("tensor_parallel_size: not with kv_role (disaggregation) yet")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {self.cuda_graph_max_bs}")
        if self.prompt_graph_max_tokens < 0:
            raise ValueError("prompt_graph_max_tokens: must be >= 0, got "
                             f"{self.prompt_graph_max_tokens}")
        if self.kv_role not in (None, "prefill", "decode", "both"):
            raise ValueError(f"kv_role: unsupported {self.kv_role!r} (prefill, decode, both)")
        if not self.kv_lease_s > 0 or not self.kv_transfer_timeout_s > 0:
            raise ValueError("kv_lease_s / kv_transfer_timeout_s: must be > 0")
        if self.kv_transport not in ("auto", "nixl"):
            raise ValueError(f"kv_transport: unsupported {self.kv_transport!r} (auto, nixl)")
        if self.kv_role is not None and not self.kv_secret:
            raise ValueError("kv_secret: prefill/decode workers need the deployment's shared "
                             "secret (--kv-secret or $FRUGAL_KV_SECRET; `frugal serve-pd` makes "
                             "one): it signs hand-offs and guards the KV side channel")
        if not 0 < self.kv_max_held_fraction <= 1:
            raise ValueError(f"kv_max_held_fraction: must be in (0, 1], got "
                             f"{self.kv_max_held_fraction}")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_batched_tokens(self) -> int:
        """The step's token budget: the scheduler config's, else by the device's memory."""
        tokens = self.scheduler.max_num_batched_tokens
        if tokens is not None:
            return tokens
        device = self.resolved_device()
        big = device.startswith("cuda") and torch.cuda.get_device_properties(
            torch.device(device)).total_memory >= BIG_GPU_BYTES
        return 8192 if big else 2048

    def resolved_ops_backend(self) -> str:
        if self.ops_backend != "auto":
            return self.ops_backend
        return "triton" if self.resolved_device().startswith("cuda") else "torch_ref"

    def resolved_dtype(self, model: ModelConfig) -> torch.dtype:
        """'auto': fp32 on CPU (fast and exact there); the checkpoint's half dtype on GPU."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device() == "cpu":
            return torch.float32
        half = DTYPES.get(model.dtype)
        return half if half in (torch.float16, torch.bfloat16) else torch.bfloat16
