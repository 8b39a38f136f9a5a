"""PRISM's local step (Algorithm 1): a DP release in the tangent space of the LoRA factors.

Per step: each example's factor gradients are lifted to the tangent space at the current point
and globally clipped together with its DP-head gradient (or with the head held to its own share
``head_max_norm`` of C), summed over every micro-batch, fused in
``prism_core.mechanism.clip_and_sum_whitened`` with the QR frames computed once per step
(``PrismTrainer.clipped_sum``): the LoRA layers' backward writes each example's gradient rows,
whitened by those frames, straight into stacked buffers (``StepRows``). Then tangent noise once,
divided by the EXPECTED batch size (``PrismTrainer.release``); then the DP-aware adaptive
transform and the retraction. The head steps with AdamW or (heavy-ball) SGD
(``head_optimizer``). Siamese text pairs: the encoder's per-text gradient rows are folded into
one per example (``prism_runtime.classifier.fold_text_rows``) before the clip. At the person
level a person's per-example factor and head gradients are then summed into one row
(``fold_units``): one clip coefficient per person, in the intrinsic norm, the same split with
the head, also for a person whose records span several micro-batches (``UnitFold``); both
folds are sums, applied to the whitened rows alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import torch
from torch import Tensor
from torch.utils.data import Dataset

from prism_core.accounting import PrivacyEvent
from prism_core.adaptive import AdaptiveState, adaptive_directions, init_state
from prism_core.manifold import Point
from prism_core.mechanism import (
    ClippedSum,
    PrivateStep,
    StepFrames,
    clip_and_sum_grads,
    clip_and_sum_whitened,
    empty_sum,
    privatize,
    retract_modules,
    step_frames,
)
from prism_runtime import per_example
from prism_runtime.classifier import fold_text_rows
from prism_runtime.data.units import packed_groups
from prism_runtime.errors import ConfigError
from prism_runtime.head_optimizer import head_optimizer
from prism_runtime.lora import LoraHandle, per_example_factor_grads, read_points, write_points_
from prism_runtime.model import LoadedModel
from prism_runtime.train_config import TrainConfig
from prism_runtime.trainer.base import StepResult
from prism_runtime.trainer.dp import DPTrainer, Fold, grad_sample

__all__ = ["ClipFn", "PrismTrainer", "PrivatizeFn", "StepRows"]

ClipFn = Callable[..., ClippedSum]
"""Signature of ``prism_core.mechanism.clip_and_sum_grads``."""
PrivatizeFn = Callable[..., PrivateStep]
"""Signature of ``prism_core.mechanism.privatize``."""


def _fold_pairs(
    pairs: Sequence[tuple[Tensor, Tensor]], head: list[Tensor], n: int, fold: Fold | None
) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
    """Per-text factor rows ``(b, ...)`` of a micro-batch's ``n`` examples summed into one per
    example (siamese pairs, ``fold_text_rows``), then, with ``fold``, examples and head rows
    into people (``UnitFold``)."""
    flat = [fold_text_rows(t, n) for pair in pairs for t in pair]
    if fold is not None:
        folded = fold([*flat, *head])
        flat, head = folded[: len(flat)], folded[len(flat) :]
    return list(zip(flat[0::2], flat[1::2], strict=True)), head


def _fold_rows(
    rows: list[tuple[Tensor, Tensor]], head: list[Tensor], n: int, fold: Fold | None
) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
    """``_fold_pairs`` of stacked whitened rows (L, texts, r, k), the example dimension second:
    both folds are sums, so they commute with the whitening. Unchanged when neither applies."""
    texts = int(rows[0][0].shape[1]) if rows else n
    if fold is None and texts == n:
        return rows, head
    moved = [(a.movedim(1, 0), c.movedim(1, 0)) for a, c in rows]
    pairs, head = _fold_pairs(moved, head, n, fold)
    back = [(a.movedim(0, 1).contiguous(), c.movedim(0, 1).contiguous()) for a, c in pairs]
    return back, head  # the clip's layout, copied once


class StepRows:
    """The whitened per-example rows of one step's micro-batches, written by the LoRA layers.

    ``prepare(micro)`` points every LoRA factor's ``RowSink`` at the micro-batch's next slice of
    the open stacked buffers, (L, rows, r, m) and (L, rows, r, n) per shape group of ``frames``,
    whitened by its module's frame (``lora_B``: ``RB^{-1}``, ``lora_A``: ``RA^{-1}``). When the
    open buffers have no room it allocates the next: of the next size of ``buffers`` (encoder
    rows of consecutive micro-batches, two an example for siamese pairs: ``texts_per_example``),
    or of the micro-batch's own size when none is left. Once a buffer is ``full``, ``rows()``
    returns it, after the last backward, for ``clip_and_sum_whitened``; ``close()`` takes the
    sinks down. A factor whose slot a backward did not write (a module the loss does not reach)
    is an error, never uninitialised memory in a sum (``ConfigError`` naming the modules).
    """

    def __init__(
        self,
        handles: Sequence[LoraHandle],
        frames: StepFrames,
        *,
        texts_per_example: int = 1,
        buffers: Sequence[int] = (),
    ) -> None:
        self.handles, self.frames, self.texts = handles, frames, texts_per_example
        self._sizes = iter(buffers)
        self._sinks: list[tuple[str, per_example.RowSink]] = []
        self._rows: list[tuple[Tensor, Tensor]] = []
        self._filled = 0

    @property
    def _capacity(self) -> int:
        return int(self._rows[0][0].shape[1]) if self._rows else 0

    @property
    def full(self) -> bool:
        """Whether the open buffers are filled (their rows are ready for one clip)."""
        return bool(self._rows) and self._filled == self._capacity

    @property
    def examples(self) -> int:
        """The examples whose rows the open buffers hold."""
        return self._filled // self.texts

    def _open(self, rows: int) -> None:
        self._sinks, self._rows, self._filled = [], [], 0
        for stacked, point in zip(self.frames.stacked, self.frames.points, strict=True):
            L, m, r = point.A.shape
            n = point.B.shape[1]
            like = stacked.QA
            rows_a = torch.empty((L, rows, r, m), dtype=like.dtype, device=like.device)
            rows_c = torch.empty((L, rows, r, n), dtype=like.dtype, device=like.device)
            self._rows.append((rows_a, rows_c))

    def prepare(self, micro: dict[str, Tensor]) -> None:
        """Sinks for ``micro``'s encoder rows (``texts_per_example`` an example) at the open
        buffers' next slice, opening the next buffers if these have no room (the class)."""
        b = int(micro["labels"].shape[0]) * self.texts
        if self._capacity - self._filled < b:
            self._open(next(self._sizes, b))
        at = slice(self._filled, self._filled + b)
        self._filled += b
        for group, stacked, (rows_a, rows_c) in zip(
            self.frames.groups, self.frames.stacked, self._rows, strict=True
        ):
            for j, i in enumerate(group):
                h = self.handles[i]
                sink_a = per_example.RowSink(rows_a[j, at], stacked.RB_inv[j], "input")
                sink_c = per_example.RowSink(rows_c[j, at], stacked.RA_inv[j], "output")
                per_example.set_sink(h.lora_B, sink_a)
                per_example.set_sink(h.lora_A, sink_c)
                self._sinks += [(h.name, sink_a), (h.name, sink_c)]

    def rows(self) -> list[tuple[Tensor, Tensor]]:
        """The whitened rows of the micro-batches of the open buffers, one pair per group, their
        filled part (after the last one's backward)."""
        missing = sorted({name for name, sink in self._sinks if not sink.filled})
        if missing:
            raise ConfigError(
                f"LoRA modules {missing} got no per-example gradient rows: the loss does not "
                "reach them (e.g. a pooler the classifier does not read); leave them out of "
                "target-modules"
            )
        rows = [(a[:, : self._filled], c[:, : self._filled]) for a, c in self._rows]
        self._sinks, self._rows, self._filled = [], [], 0
        return rows

    def close(self) -> None:
        """Give the layers back their ``grad_sample`` rows."""
        per_example.clear_sinks(w for h in self.handles for w in (h.lora_A, h.lora_B))
        self._sinks, self._rows, self._filled = [], [], 0


class PrismTrainer(DPTrainer):
    """PRISM: tangent-space clip and noise, adaptive transform, retraction of the LoRA factors.

    Takes ``PrivateTrainer``'s arguments. ``states`` holds the adaptive transform's moments of
    every LoRA module (post-processing of DP releases: a site keeps them across rounds);
    ``optimizer`` steps the DP head (None without one).
    """

    methods: ClassVar[frozenset[str]] = frozenset({"prism"})
    whitened_rows: bool = True
    """With per-example gradients in the layers (``grad_sample_mode='layer'``), the LoRA layers
    write whitened rows for ``clip_and_sum_whitened`` (``StepRows``). False (or Opacus' hooks):
    ``grad_sample`` rows and ``clip_and_sum_grads``, the same clipped sum (a benchmark's and
    the tests' reference)."""

    def __init__(
        self,
        loaded: LoadedModel,
        dataset: Dataset[dict[str, object]],
        config: TrainConfig,
        *,
        history: Sequence[PrivacyEvent] = (),
        units: Sequence[Hashable] | None = None,
    ) -> None:
        super().__init__(loaded, dataset, config, history=history, units=units)
        self.states: list[AdaptiveState] = [
            init_state(p.A, p.B) for p in read_points(loaded.handles)
        ]
        self.adaptive = config.adaptive.to_config()
        self.optimizer = head_optimizer(loaded.head_params, config)

    # -- the clip and the release ----------------------------------------------------------

    def _example_grads(
        self, n: int, fold: Fold | None = None
    ) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """Per-example factor gradients ``(gA, gB)`` of every LoRA module and the head's, for
        the ``n`` examples of the last backward (siamese pairs: 2 encoder rows folded into 1);
        per completed person when ``fold`` is given (``UnitFold``)."""
        head = [grad_sample(p).to(torch.float32) for p in self.loaded.head_params]
        return _fold_pairs(per_example_factor_grads(self.loaded.handles), head, n, fold)

    def clipped_sum(
        self,
        batch: dict[str, Tensor],
        points: Sequence[Point],
        *,
        frames: StepFrames | None = None,
        clip_fn: ClipFn | None = None,
    ) -> tuple[ClippedSum, float]:
        """Globally clipped sum of per-example lifts (and DP-head grads) over micro-batches; at
        the person level of per-person sums (``batch`` then carries its ``unit``).

        The lifts are fused into the clip: ``clip_and_sum_whitened`` on the rows the layers
        write whitened (``StepRows``; with Opacus' hooks or ``whitened_rows = False``,
        ``clip_and_sum_grads`` on the ``grad_sample`` rows); ``frames`` (the per-step QR frames
        of ``points``) are computed once per step, not per micro-batch. A ``clip_fn`` (with
        ``clip_and_sum_grads``' signature) replaces the clip on the ``grad_sample`` rows: the
        privacy self-audit (``server.audit``) passes deliberately broken variants to prove it
        catches them.

        Returns the ``ClippedSum`` and the summed per-sequence loss (private, local only).
        """
        if frames is None:
            frames = step_frames(points)
        if clip_fn is None and self._writes_whitened_rows():
            return self._whitened_sum(batch, points, frames)
        clip = clip_and_sum_grads if clip_fn is None else clip_fn
        acc, total = None, 0.0
        split = self._head_split()
        for n, loss, fold in self._example_passes(batch):
            total += loss
            grads, head_grads = self._example_grads(n, fold)
            acc = clip(
                points,
                grads,
                max_norm=self.config.max_norm,
                previous=acc,
                euclidean=head_grads,
                frames=frames,
                **split,
            )
            del grads, head_grads  # the rows go before the next micro-batch's forward
        return (acc if acc is not None else empty_sum(points, self.loaded.head_params)), total

    def _writes_whitened_rows(self) -> bool:
        return self.whitened_rows and self.config.grad_sample_mode == "layer"

    def _whitened_sum(
        self, batch: dict[str, Tensor], points: Sequence[Point], frames: StepFrames
    ) -> tuple[ClippedSum, float]:
        """``clipped_sum`` with the layers writing whitened rows (``StepRows``).

        At the record level with one text an example, consecutive micro-batches write into one
        buffer of at most ``micro_batch_size`` rows, clipped once (``packed_groups``): length-aware
        micro-batches are mostly far smaller than that (about 15 rows against 64 on SST-2 at
        batch 128), and a clip call has a fixed cost. The memory is the one micro-batch's rows
        the choice of ``micro_batch_size`` budgets for. Otherwise (a person's fold, siamese
        pairs) each micro-batch is clipped alone, as its rows must be folded alone."""
        acc, total = None, 0.0
        split = self._head_split()
        spec = self.loaded.spec
        texts = 2 if spec is not None and spec.siamese else 1
        micros = list(self._micro_batches(batch))
        sizes = [int(micro["labels"].shape[0]) for micro in micros]
        together = self.privacy_unit == "record" and texts == 1
        buffers, start = [], 0
        for count in packed_groups(sizes, self.micro_batch_size if together else 0):
            buffers.append(sum(sizes[start : start + count]) * texts)
            start += count
        step_rows = StepRows(self.loaded.handles, frames, texts_per_example=texts, buffers=buffers)
        heads: list[list[Tensor]] = []
        try:
            passes = self._example_passes(batch, before=step_rows.prepare, micros=micros)
            for _, loss, fold in passes:
                total += loss
                heads.append([grad_sample(p).to(torch.float32) for p in self.loaded.head_params])
                if not step_rows.full:
                    continue
                head = [torch.cat(parts) for parts in zip(*heads, strict=True)]
                heads = []
                n = step_rows.examples
                rows, head = _fold_rows(step_rows.rows(), head, n, fold)
                acc = clip_and_sum_whitened(
                    points,
                    rows,
                    frames=frames,
                    max_norm=self.config.max_norm,
                    previous=acc,
                    euclidean=head,
                    **split,
                )
                del rows, head  # the rows go before the next group's forward
        finally:
            step_rows.close()
        return (acc if acc is not None else empty_sum(points, self.loaded.head_params)), total

    def release(
        self,
        batch: dict[str, Tensor],
        points: Sequence[Point],
        *,
        frames: StepFrames | None = None,
        clip_fn: ClipFn | None = None,
        privatize_fn: PrivatizeFn | None = None,
    ) -> tuple[PrivateStep, ClippedSum, float]:
        """The DP release of one PRISM step on ``batch`` at ``points`` (before post-processing).

        Global clip over every micro-batch, then tangent noise once, divided by the EXPECTED
        batch size. ``clip_fn``/``privatize_fn`` default to ``prism_core``'s functions; only the
        privacy self-audit replaces them (with deliberately broken variants).

        Returns:
            The released ``PrivateStep``, the (private) ``ClippedSum`` and the summed loss.
        """
        if frames is None:
            frames = step_frames(points)
        noisy = privatize if privatize_fn is None else privatize_fn
        acc, total = self.clipped_sum(batch, points, frames=frames, clip_fn=clip_fn)
        released = noisy(
            points,
            acc,
            noise_multiplier=self.noise_multiplier,
            max_norm=self.config.max_norm,
            expected_batch_size=self.expected_batch_size,
            sample_rate=self.sample_rate,
            generator=self.noise,
            frames=frames,
        )
        return released, acc, total

    def secure_clipped_sum(self) -> tuple[ClippedSum, StepFrames]:
        """One step's clipped sum at the current point for secure aggregation, with its frames.

        The next Poisson batch, the global clip of ``clipped_sum``, and nothing else: no noise
        (the site adds its discrete share, ``prism_core.distributed``), no move of the factors
        or the head (the coordinator steps on the unmasked sum). The result is PRIVATE.
        """
        batch = self._next_batch()
        points = read_points(self.loaded.handles)
        frames = step_frames(points)
        with self._autocast():
            acc, _ = self.clipped_sum(batch, points, frames=frames)
        self.steps_done += 1
        return acc, frames

    def private_gradient(self) -> tuple[PrivateStep, StepResult]:
        """One step's DP release at the current point, not applied (``step-at = coordinator``).

        ``step`` with ``release`` in place of ``_run_step``: the next Poisson batch, the global
        clip and the noise, divided by the expected batch, recorded and composed like any step;
        the adaptive transform, the retraction and the head's step run at the coordinator on
        the sites' weighted mean (``server.strategy.central``). Nothing moves here. The release
        is the DP quantity a site sends; the returned ``StepResult``'s loss and batch size are
        private.
        """
        released: list[PrivateStep] = []

        def release_only(batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent]:
            out, _, total = self.release(batch, read_points(self.loaded.handles))
            released.append(out)
            return total / max(int(batch["labels"].shape[0]), 1), out.record

        result = self.step(release_only)
        return released[0], result

    def count_within(self, max_norm: float, *, lora_only: bool) -> tuple[int, int]:
        """On the next Poisson batch: ``(units, units whose clipped norm is <= max_norm)``, the
        units being examples, or people at the person level.

        The norm is the one ``clipped_sum`` clips: the intrinsic norm of the lift (eq. 15),
        joined by the DP head's gradient unless ``lora_only`` (a split clip estimates the LoRA
        part alone); a unit is below when its clip coefficient is 1. No parameter moves.
        """
        batch = self._next_batch()
        points = read_points(self.loaded.handles)
        frames = step_frames(points)
        count = below = 0
        with self._autocast():
            for n, _, fold in self._example_passes(batch):
                grads, head_grads = self._example_grads(n, fold)
                acc = clip_and_sum_grads(
                    points,
                    grads,
                    max_norm=max_norm,
                    euclidean=[] if lora_only else head_grads,
                    frames=frames,
                )
                count, below = count + acc.count, below + acc.count - acc.clipped
                del grads, head_grads  # the rows go before the next micro-batch's forward
        return count, below

    # -- post-processing -------------------------------------------------------------------

    def _run_step(self, batch: dict[str, Tensor]) -> tuple[float, PrivacyEvent]:
        cfg, handles, head = self.config, self.loaded.handles, self.loaded.head_params
        points = read_points(handles)
        frames = step_frames(points)
        released, _, total = self.release(batch, points, frames=frames)
        noise_std = self.noise_multiplier * cfg.max_norm / self.expected_batch_size
        directions, self.states = adaptive_directions(
            points,
            released.tangents,
            self.states,
            groups=frames.groups,
            noise_std=noise_std,
            config=self.adaptive,
        )
        write_points_(handles, retract_modules(frames, directions, -cfg.lr))
        if self.optimizer is not None:
            for p, g in zip(head, released.euclidean, strict=True):
                p.grad = g.to(p.dtype)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return total / max(int(batch["labels"].shape[0]), 1), released.record
