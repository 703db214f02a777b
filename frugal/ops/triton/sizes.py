"""Grid and block sizes on the host. Triton's own `triton.cdiv` and `triton.next_power_of_2`
are constexpr functions since Triton 3.5: a host call unwraps its arguments and costs a few
microseconds, and a prompt step of a 48-layer MoE model made about a thousand of them."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for b > 0 (as triton.cdiv)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1; 0 for 0 (as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
