"""The quality benchmark's task and model: a small LLaVA trained from scratch to read tagged pages.

- ``quality.generator``: pages (Pillow), multi-page requests, questions, splits (seeded).
- ``quality.tokenizer`` / ``quality.model_config``: the tokenizer, the LLaVA-1.5 architecture, the HF folder.
- ``quality.data``: page pools, tokenization, training batches.
- ``quality.train``: the training script (``python -m quality.train --out DIR``).
- ``quality.evaluate``: full-prefill exact match through transformers.
- ``quality.stale_kv``: the `none` policy (stale page KV, RoPE re-applied) in plain transformers.

See quality/README.md for the task and why stale KV hurts on it.
"""
