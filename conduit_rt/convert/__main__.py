"""``python -m convert SRC --outdir DIR [--dtype f32|f16|bf16|q8_0]``."""
from .cli import main

raise SystemExit(main())
