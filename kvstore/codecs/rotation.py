"""A Hadamard rotation along head_dim, applied before quantising and undone after (QuaRot style).

Keys have a few outlier channels and a row's quantisation step follows its largest element; an
orthogonal rotation spreads each outlier over the whole group, so the row's amax falls towards its
RMS and every other element gets a finer step. The rotation is the Sylvester Hadamard matrix
``H_n`` (entries +-1, symmetric, ``H_n @ H_n = n I``) on each group of ``n`` consecutive dims,
``n = size(head_dim)``: the largest power of two dividing head_dim, at most 64 (64 for head_dim
64, 128 or 576; 1, no rotation, for an odd one).

Encode rotates ``x / n`` (so no sum can exceed the row's largest magnitude: nothing overflows),
decode rotates the dequantised values back (``H_n (H_n x / n) = x``). Both run the same
constant-geometry butterflies: ``log2(n)`` stages, each writing ``a + b`` into the first half and
``a - b`` into the second half for every adjacent pair ``(a, b)``. Every output is one IEEE sum or
difference of two float32 values and the scaling is by a power of two, so the result is the same
bits on every device and in ``fast_cpu``'s kernels, which run the same stages.
"""

from __future__ import annotations

import torch

#: the largest rotation: 6 butterfly stages; larger ones cost more passes for little gain
MAX_SIZE = 64


def size(dim: int) -> int:
    """The rotation's group size for rows of ``dim`` elements."""
    n = 1
    while n < MAX_SIZE and dim % (2 * n) == 0:
        n *= 2
    return n


def rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """``H_n`` applied to each group of ``n`` along the last axis of ``x`` (float32); a new tensor
    of ``x``'s shape. Applied twice it gives ``n * x`` exactly where no sum rounds."""
    y = x.reshape(-1, n)
    for _ in range(n.bit_length() - 1):
        pairs = y.view(y.shape[0], n // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        y = torch.cat((a + b, a - b), dim=-1)
    return y.reshape(x.shape)


def rotate_for_encode(x: torch.Tensor, n: int) -> torch.Tensor:
    """``H_n (x / n)``: the rotated row whose elements are never larger than ``x``'s largest."""
    if n == 1:
        return x
    return rotate(x.mul(1.0 / n), n)   # (a power of two: exact on every device)
