"""The quality benchmark's task and model: a small LLaVA trained from scratch to read tagged pages.

- ``generator``: pages (Pillow), multi-page requests, questions, splits (seeded).
- ``tokenizer`` / ``model_config``: the tokenizer, the LLaVA-1.5 architecture, the HF folder.
- ``data``: page pools, tokenization, training batches.
- ``train``: the training script (``python -m conduit_rt.evaluation.task.train --out DIR``).
- ``evaluate``: full-prefill exact match through transformers.
- ``stale_kv``: the `none` policy (stale page KV, RoPE re-applied) in plain transformers.

See docs/quality/task.md for the task and why stale KV hurts on it.
"""
