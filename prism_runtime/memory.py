"""The micro-batch a trainer chooses from the memory it has (``micro_batch_size = 0``, auto).

The micro-batch only bounds memory: the clipped sum of a step is the same whatever the
micro-batches (up to float rounding), so a site chooses it alone, from its own memory, and says
what it chose. ``auto_micro_batch`` estimates one example's training memory from public facts
(the model's shapes, the longest row, the LoRA modules) and takes the largest micro-batch whose
estimate fits in ``MEMORY_SHARE`` of the memory available now, at most ``CPU_MICRO_BATCH_MAX``
on a CPU (where a larger one is not faster) and ``GPU_MICRO_BATCH_MAX`` on a GPU.

The estimate per example (float32; docs/design.md "Memory per example"):

- activations kept for the backward: ``T x layers x (16 hidden + 2 intermediate + 2 heads T)``
  values for T tokens (attention inputs and outputs, layer norms, the feed-forward's two
  activations, the attention probabilities and their dropout mask); twice for a siamese pair;
- the per-example gradient rows of every LoRA module, ``(m + n) r`` values, and, on the path
  from ``grad_sample`` rows, their stacked copy in the clip: ``2 (m + n) r`` values a module
  (the whitened rows PRISM's layers write need one; the estimate keeps the larger).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from prism_runtime.model import LoadedModel

__all__ = [
    "CPU_MICRO_BATCH_MAX",
    "GPU_MICRO_BATCH_MAX",
    "MEMORY_SHARE",
    "MicroBatchChoice",
    "auto_micro_batch",
    "available_bytes",
    "bytes_per_example",
]

MEMORY_SHARE = 0.25
"""The share of the available memory a micro-batch's estimate may take (the rest: the model,
the optimizer, the data, the estimate's error, other processes)."""
CPU_MICRO_BATCH_MAX = 64
"""The largest automatic micro-batch on a CPU: larger ones are not faster there (the step
benchmark's length-aware micro-batching, docs/benchmarks.md)."""
GPU_MICRO_BATCH_MAX = 1024
"""The largest automatic micro-batch on a GPU."""
_FLOAT = 4


@dataclass(frozen=True)
class MicroBatchChoice:
    """What ``auto_micro_batch`` chose and from what (public facts and this machine's memory)."""

    size: int
    per_example: int  # bytes, the estimate
    available: int  # bytes available when chosen
    device: str

    def describe(self) -> str:
        """One line for the log: the choice and its reasons."""
        return (
            f"micro-batch {self.size} (auto: about {self.per_example / 2**20:.1f} MiB an "
            f"example, {self.available / 2**30:.1f} GiB available on {self.device}, "
            f"{MEMORY_SHARE:.0%} of it for a micro-batch)"
        )


def available_bytes(device: torch.device) -> int:
    """Memory available now: free GPU memory on CUDA, else the OS's ``MemAvailable``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def bytes_per_example(loaded: LoadedModel, max_length: int) -> int:
    """The estimated training memory of one example of ``max_length`` tokens (module docstring)."""
    hf = loaded.model.config
    hidden = int(getattr(hf, "hidden_size", 0) or 0)
    intermediate = int(getattr(hf, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(hf, "num_hidden_layers", 0) or 1)
    heads = int(getattr(hf, "num_attention_heads", 0) or 1)
    T = max(int(max_length), 1)
    texts = 2 if loaded.spec is not None and loaded.spec.siamese else 1
    activations = texts * T * layers * (16 * hidden + 2 * intermediate + 2 * heads * T)
    rows = sum(2 * (m + n) * r for m, n, r in (h.shape for h in loaded.handles))
    return _FLOAT * (activations + rows)


def auto_micro_batch(
    loaded: LoadedModel, max_length: int, *, available: int | None = None
) -> MicroBatchChoice:
    """The micro-batch for ``loaded`` on rows of at most ``max_length`` tokens (module
    docstring); ``available`` overrides the measured free memory (bytes)."""
    device = loaded.device
    free = available_bytes(device) if available is None else int(available)
    per_example = bytes_per_example(loaded, max_length)
    cap = GPU_MICRO_BATCH_MAX if device.type == "cuda" else CPU_MICRO_BATCH_MAX
    size = max(1, min(cap, int(MEMORY_SHARE * free) // max(per_example, 1)))
    return MicroBatchChoice(size, per_example, free, str(device))
