"""python -m zipage_jax ...: the console script zipage-jax (zipage_jax/cli.py)."""

import sys

from zipage_jax.cli import main

sys.exit(main())
