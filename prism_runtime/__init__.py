"""What the site and the coordinator share: their contract and the model runtime.

The contract: the run and site configuration (``config``), message keys and codecs
(``protocol``, ``exchange``), errors (``errors``), durable writes (``durable``) and the test-only
fault injection (``faults``). The Hugging Face runtime both sides and ``prism-train`` use:
model loading and LoRA handles (``model``, ``lora``), pooling and head (``classifier``), data
(``data``, ``synthetic``), the private trainer (``trainer``), export and evaluation (``export``,
``evaluate``) and the start-up caches (``cache``, ``init_cache``, ``shard_cache``). The math lives
in ``prism_core``; the ClientApp and the site's policy in ``client``; the ServerApp, strategy,
ledger, reports and audit in ``server``. Neither of those two imports the other.

"""
