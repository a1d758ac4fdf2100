"""The quality benchmark's task and model: a small LLaVA trained from scratch to read tagged pages.

- ``conduit_rt.evaluation.task.generator``: pages (Pillow), multi-page requests, questions, splits (seeded).
- ``conduit_rt.evaluation.task.tokenizer`` / ``conduit_rt.evaluation.task.model_config``: the tokenizer, the LLaVA-1.5 architecture, the HF folder.
- ``conduit_rt.evaluation.task.data``: page pools, tokenization, training batches.
- ``conduit_rt.evaluation.task.train``: the training script (``python -m conduit_rt.evaluation.task.train --out DIR``).
- ``conduit_rt.evaluation.task.evaluate``: full-prefill exact match through transformers.
- ``conduit_rt.evaluation.task.stale_kv``: the `none` policy (stale page KV, RoPE re-applied) in plain transformers.

See quality/README.md for the task and why stale KV hurts on it.
"""
