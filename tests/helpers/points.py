"""Test helper: random factor pairs ``(A, B)`` and ill-conditioned ``r x r`` matrices, seeded,
in float64 by default; the seeds and shapes the manifold tests sweep."""

from __future__ import annotations

import torch

SEEDS = [0, 1, 2]
SHAPES = [(12, 9, 3), (20, 31, 5), (16, 16, 1), (7, 40, 7)]  # (m, n, r), incl. r = min(m, n)


def random_point(m: int, n: int, r: int, seed: int, dtype: torch.dtype = torch.float64):
    """A random full-rank factor pair (A, B) of shapes (m, r), (n, r)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g, dtype=dtype), torch.randn(n, r, generator=g, dtype=dtype)


def ill_conditioned(r: int, seed: int, cond: float, dtype: torch.dtype = torch.float64):
    """A random R in GL(r) with condition number ``cond`` (orthogonal x log-spaced x orthogonal)."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=dtype))
    V, _ = torch.linalg.qr(torch.randn(r, r, generator=g, dtype=dtype))
    s = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), r, dtype=dtype)
    return U @ torch.diag(s) @ V.T
