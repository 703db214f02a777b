"""Weight quantization: INT4 (W4A16, group-wise) in memory and on disk."""

import torch


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded as IEEE division on every device. (CUDA turns division by a Python
    number into multiplication by its reciprocal, which can land one ulp away: a scale of
    amax / 7.5 then sends a group's largest weight to either side of the ±7.5 rounding tie, and
    the same checkpoint quantizes to other codes on the GPU than on the CPU.)"""
    return x / torch.full_like(x, divisor)
