"""Data loading for one training site: read, validate, tokenize, batch and partition examples.

Pipeline::

    examples = load_examples("train.jsonl", "seq-cls")
    dataset = TokenizedDataset(examples, tokenizer, "seq-cls", max_length=128)
    collate = make_collate(tokenizer, "seq-cls")
    loader, q = poisson_loader(dataset, expected_batch_size=64, collate_fn=collate,
                               generator=torch.Generator().manual_seed(0))
    for batch in loader:                      # Poisson-sampled logical batch, may be empty
        for micro in micro_batches(batch, 16):  # virtual steps bounded by memory
            ...

Supported inputs are JSON Lines, CSV with a header row, and a folder written by
``datasets.Dataset.save_to_disk``. Two tasks are supported:

* ``"seq-cls"``: ``text`` + ``label``, or the pair ``text_a`` + ``text_b`` + ``label``; labels are
  integers ``>= 0`` (CSV cells such as ``"1"`` are accepted). ``prism_runtime.data.labels`` says
  how many classes they make; ``prism_runtime.data.settings`` resolves the run config's data
  settings (``text-pairs``, ``num-labels``, ``label-texts``, ``head-init``) from them.
* ``"causal-lm"``: instruction tuning with ``instruction``, optional ``input``, ``output`` and an
  optional ``answer``. When ``output`` is empty or absent the ``answer`` becomes the training
  target (MAWPS-style data ships an empty ``output`` and the result in ``answer``).

Unknown fields are ignored.
"""

from __future__ import annotations

from prism_runtime.data.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    length_groups,
    make_collate,
    micro_batches,
    poisson_loader,
)
from prism_runtime.data.partition import dirichlet_partition, iid_partition
from prism_runtime.data.reading import (
    IGNORE_INDEX,
    PAIR_ENCODINGS,
    PROMPT_NO_INPUT,
    PROMPT_WITH_INPUT,
    TASKS,
    Collate,
    Example,
    ExampleFile,
    load_examples,
    read_examples,
)
from prism_runtime.data.tokenize import TokenizedDataset, format_prompt

__all__ = [
    "IGNORE_INDEX",
    "MICRO_BATCH_OVERHEAD_TOKENS",
    "PAIR_ENCODINGS",
    "PROMPT_NO_INPUT",
    "PROMPT_WITH_INPUT",
    "TASKS",
    "Collate",
    "Example",
    "ExampleFile",
    "TokenizedDataset",
    "dirichlet_partition",
    "format_prompt",
    "iid_partition",
    "length_groups",
    "load_examples",
    "make_collate",
    "micro_batches",
    "poisson_loader",
    "read_examples",
]
