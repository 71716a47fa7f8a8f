"""Torch steps that give the same bits on every device, in as few kernels as possible.

The reference encoder runs these on whatever device the block is on, and its payload must be
byte-identical to the CPU's and to ``fast_cpu``'s: every step here is exactly rounded (true
float32 division, round-to-nearest-even casts, directed rounding by ``nextafter``), independent
of reduction order (min/max are exact; the sign of a zero is canonicalised), and never divides
by a Python number (CUDA would multiply by an inexact reciprocal). Each op is a CUDA kernel
launch, so constants are made once per device and reductions take their single-kernel form on
CUDA. Imports nothing from the rest of kvstore.
"""

from __future__ import annotations

import functools
import math

import torch


def one_kernel_reductions(device: torch.device) -> bool:
    """Whether ``max_abs`` / ``min_max`` use their single-kernel forms: on CUDA, where each op is
    a launch; torch's CPU versions of those forms are not vectorised (~15x slower)."""
    return device.type == "cuda"


def max_abs(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """max |x| along ``dim``: exact, NaN/Inf propagate, a row of zeros gives +0, in either form
    (the inf-norm, or ``abs().amax()``)."""
    if one_kernel_reductions(x.device):
        return torch.linalg.vector_norm(x, math.inf, dim=dim)
    return x.abs().amax(dim=dim)


def min_max(x: torch.Tensor, dim: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Minima and maxima of ``x`` along ``dim`` into ``out``: exact and NaN-propagating in either
    form (``aminmax``, or ``amin`` + ``amax``); only which zero a mixed +0/-0 group yields may
    differ, so callers apply ``canonical_zero``."""
    if one_kernel_reductions(x.device):
        torch.aminmax(x, dim=dim, out=out)
    else:
        torch.amin(x, dim=dim, out=out[0])
        torch.amax(x, dim=dim, out=out[1])


def finiteness_check(stats: torch.Tensor, check: torch.Tensor) -> None:
    """Write into ``check`` (float64 scalar) a sum of ``stats`` that is finite iff every element
    is (float64 cannot overflow summing float32s; NaN and Inf propagate), without leaving the
    device: one reduction, read on the host later instead of a sync per ``any()``."""
    torch.sum(stats.reshape(-1), 0, dtype=torch.float64, out=check)


@functools.lru_cache(maxsize=64)
def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element ``value`` on ``device``, made once: an operand broadcast from it costs no
    fill kernel per block, and on CUDA it is a device tensor, never the CPU scalar that
    ``div_exact`` must avoid. Read-only."""
    t = torch.full((1,), value, dtype=dtype, device=device)
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)  # filled before any stream reads it
    return t


def div_exact(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device.

    Never write ``tensor / python_number`` in a codec: CUDA torch computes a division by a CPU
    scalar as ``x * (1 / divisor)`` (``div_true_kernel_cuda``), one rounding more, so whenever
    ``1 / divisor`` is inexact (1/448, 1/15) some quotients come out one ulp high, e.g.
    ``1.3125 / 448 = 0.0029296875`` (a bf16 value) but ``1.3125 * fl(1/448) = 0.0029296877``,
    which ``round_up`` then bumps to the next bf16. The CPU and ``fast_cpu`` divide exactly.
    A tensor / tensor division (here by a one-element tensor on ``x``'s device) is a true IEEE
    division on both devices."""
    return x / constant(divisor, x.dtype, x.device)


def canonical_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -0.0 replaced by +0.0 (``x + 0.0``: IEEE gives ``-0 + +0 = +0`` and leaves
    every other value, NaN and Inf included, as it is). Which zero a min/max reduction returns
    for a group holding both depends on the order it visits them (CPU vector lanes, CUDA thread
    blocks, the compiled kernels' loop); statistics computed from it must not."""
    return x + 0.0


def round_up(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (float32, >= 0) in ``dtype``, never smaller than ``x``: a stored scale must still
    cover the range it was computed for. Written into ``out`` (of ``dtype``) when given."""
    y = x.to(dtype)
    up = torch.nextafter(y, constant(math.inf, dtype, x.device))
    return torch.where(torch.lt(y, x), up, y, out=out)  # (y < x compares in float32, exactly)


def round_down(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (float32) in ``dtype``, never larger than ``x``: a stored minimum must stay below
    every value of its group. Written into ``out`` (of ``dtype``) when given."""
    y = x.to(dtype)
    down = torch.nextafter(y, constant(-math.inf, dtype, x.device))
    return torch.where(torch.gt(y, x), down, y, out=out)


def nonzero_or_one(scale: torch.Tensor) -> torch.Tensor:
    """The divisor for a stored scale: a zero scale (all of its group equal) divides by 1."""
    return torch.where(scale == 0, constant(1.0, scale.dtype, scale.device), scale)
