"""Per-example gradients computed inside the trainable linear layers, without module hooks.

Every tensor a DP step trains is the weight (and bias) of an ``nn.Linear``: peft's ``lora_A``
(r x n) and ``lora_B`` (m x r) of each LoRA module, and the classifier head. A linear layer's
backward already holds everything its per-example gradients need: its input ``x`` (b, ..., in)
and the gradient ``g`` (b, ..., out) of its output. Example i's weight gradient is
``sum_t g_it x_it^T``, one batched matmul ``g_i^T x_i`` over the layer's positions t, and its
bias gradient ``sum_t g_it``. ``attach`` gives each trainable linear layer a forward through
``_RowsLinear``, an autograd function whose backward computes those rows and the input's
gradient, and nothing else: the summed weight gradient that autograd would compute and a DP step
never reads is not formed, so the rows cost what the summed gradient costs. No module is wrapped
in a full backward hook (whose ``BackwardHookFunction`` nodes wrap every hooked module's inputs
and outputs), no activation is captured on the side.

The rows land where Opacus' ``GradSampleModule`` puts them, ``p.grad_sample`` (b, *p.shape),
summed over the calls of one backward as Opacus does, so every consumer reads one attribute
whichever path computed it (``prism_runtime.trainer.dp.grad_sample``); Opacus' hooks mode stays
selectable (``TrainConfig.grad_sample_mode = 'hooks'``) and is what the tests compare against.
LoRA dropout is applied before ``lora_A`` sees its input, so the rows are those of the dropped
input; peft's scaling ``alpha / r`` multiplies ``lora_B``'s output, so it reaches the rows
through ``g``. The rows are computed in the weight's dtype, float32 at least, whatever the
autocast dtype of the forward (the factors are float32; bf16 base weights only change the dtype
of ``x`` and ``g``).

A PRISM step asks more of the LoRA factors' backward (``RowSink``): their rows WHITENED by the
step's frames and written straight into the slot of a stacked buffer the clip reads
(``prism_core.mechanism.clip_and_sum_whitened``). Whitening is a GEMM on the layer's r-wide
operand (``lora_A``'s output gradient, ``lora_B``'s input) before the per-example product, so it
costs O(T r^2) an example; the rows then need no stacking copy and their norms no r x r Gram.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import MethodType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prism_runtime.errors import ConfigError

__all__ = ["RowSink", "attach", "attached", "clear_sinks", "detach", "set_sink", "trainable_layers"]

_FORWARD = "forward"
_SINK = "row_sink"


@dataclass
class RowSink:
    """Where a LoRA factor's backward writes its per-example rows, whitened: ``out[i]`` becomes
    ``(s_i W).T @ t_i``, (r, k), for the layer's r-wide operand ``s_i`` (T, r) and its other
    operand ``t_i`` (T, k) of example i.

    ``side`` says which operand carries the rank: ``'output'`` for ``lora_A`` (weight (r, n):
    ``s`` is the output's gradient, ``t`` the input, so ``out[i] = (W.T grad_i)`` of the weight
    gradient ``grad_i``), ``'input'`` for ``lora_B`` (weight (m, r): ``s`` is the input, ``t``
    the output's gradient, so ``out[i] = (grad_i W).T``). ``out`` is (b, r, k), contiguous (a
    slot of a stacked buffer), ``whiten`` (r, r). ``filled`` turns True at the first write; a
    second call of the layer in one backward adds to it, as ``grad_sample`` sums.
    """

    out: Tensor
    whiten: Tensor
    side: Literal["input", "output"]
    filled: bool = False

    def write(self, g: Tensor, x: Tensor) -> None:
        """Write (or add) the whitened rows from the output's gradient ``g`` (b, T, out) and
        the input ``x`` (b, T, in), computed in ``out``'s dtype."""
        small, big = (g, x) if self.side == "output" else (x, g)
        b, r, k = self.out.shape
        if small.shape[0] != b or small.shape[-1] != r or big.shape[-1] != k:
            raise RuntimeError(
                f"a row sink of shape {(b, r, k)} got operands {tuple(small.shape)} and "
                f"{tuple(big.shape)}: the sink was set for another micro-batch or layer"
            )
        dtype = self.out.dtype  # the clip's (the frames'), whatever the layer's work dtype
        small, big = small.to(dtype), big.to(dtype)
        small = small.matmul(self.whiten.to(dtype))
        if self.filled:
            self.out.add_(torch.bmm(small.mT, big))
        else:
            torch.bmm(small.mT, big, out=self.out)
            self.filled = True


def set_sink(weight: Tensor, sink: RowSink) -> None:
    """Send ``weight``'s per-example rows to ``sink`` instead of ``weight.grad_sample``."""
    setattr(weight, _SINK, sink)


def clear_sinks(weights: Iterable[Tensor]) -> None:
    """Send the rows of ``weights`` back to ``grad_sample`` (no-op where no sink is set)."""
    for w in weights:
        if hasattr(w, _SINK):
            delattr(w, _SINK)


def _store_rows(p: Tensor, rows: Tensor) -> None:
    """Add ``rows`` (b, *p.shape) to ``p.grad_sample`` (set it on the first call)."""
    prior: Tensor | None = getattr(p, "grad_sample", None)
    p.grad_sample = rows if prior is None else prior + rows  # type: ignore[attr-defined]


def _weight_rows(g: Tensor, x: Tensor) -> Tensor:
    """``sum_t g_it x_it^T`` for every example i: (b, out, in) from g (b, T, out), x (b, T, in).

    Laid out in memory with the smaller of out and in first, (b, min, max): the layout of the
    LoRA factors' rows, rank first, in which the clip stacks them without a transposing copy
    (``prism_core.mechanism._stack_grads``).
    """
    if g.shape[-1] <= x.shape[-1]:
        return torch.bmm(g.mT, x)
    return torch.bmm(x.mT, g).mT


class _RowsLinear(torch.autograd.Function):
    """``y = x W^T + b`` whose backward returns the input's gradient and stores the weight's
    and bias's per-example gradients in their ``grad_sample`` (module docstring).

    ``forward`` takes the context itself (no ``setup_context``): torch then applies it without
    binding its arguments through ``inspect.signature`` at every call (about 40 us each, a
    hundred calls a micro-batch); the function is never used under functorch transforms."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        bias: Tensor | None = ctx.bias
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g.matmul(weight.to(g.dtype)).to(x.dtype)
        b = int(g.shape[0])
        work = torch.promote_types(weight.dtype, torch.float32)  # float32 at least
        device = g.device.type  # autocast off only where it is on: entering it costs every call
        off: contextlib.AbstractContextManager[Any] = (
            torch.autocast(device, enabled=False)
            if torch.is_autocast_enabled(device)
            else contextlib.nullcontext()
        )
        with off:
            g_rows = g.reshape(b, -1, g.shape[-1]).to(work)
            if weight.requires_grad:
                x_rows = x.reshape(b, -1, x.shape[-1]).to(work)
                sink: RowSink | None = getattr(weight, _SINK, None)
                if sink is not None:
                    sink.write(g_rows, x_rows)
                else:
                    _store_rows(weight, _weight_rows(g_rows, x_rows).to(weight.dtype))
            if bias is not None and bias.requires_grad:
                _store_rows(bias, g_rows.sum(1).to(bias.dtype))
        return grad_x, None, None


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    """An attached layer's forward: through ``_RowsLinear`` when its rows will be needed."""
    trains = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
    if not (trains and torch.is_grad_enabled()):
        return F.linear(x, self.weight, self.bias)
    out: Tensor = _RowsLinear.apply(x, self.weight, self.bias)  # type: ignore[no-untyped-call]
    return out


def trainable_layers(model: nn.Module) -> list[nn.Linear]:
    """The modules of ``model`` that own a tensor with ``requires_grad``, in module order.

    Raises:
        ConfigError: one of them is not an ``nn.Linear`` (the layer path has no rows for it).
    """
    layers = []
    for name, module in model.named_modules():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"{name or 'the model'} ({type(module).__name__}) trains but is not a linear "
                "layer: per-example gradients in the layer cover nn.Linear only; use "
                "grad_sample_mode='hooks' (Opacus) for this model"
            )
        layers.append(module)
    return layers


def attach(layers: Iterable[nn.Linear]) -> None:
    """Give each of ``layers`` the per-example forward (idempotent)."""
    for layer in layers:
        layer.__dict__[_FORWARD] = MethodType(_forward, layer)


def detach(layers: Iterable[nn.Module]) -> None:
    """Give each of ``layers`` back its class's forward (no-op where none is attached)."""
    for layer in layers:
        layer.__dict__.pop(_FORWARD, None)


def attached(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose forward ``attach`` replaced."""
    return [m for m in model.modules() if _FORWARD in m.__dict__]
