"""``python3 -m conduit_rt.bench``: see ``cli``."""
from .cli import main

raise SystemExit(main())
