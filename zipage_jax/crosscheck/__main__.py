"""python -m zipage_jax.crosscheck NAME ...: the same as zipage-jax crosscheck NAME ..."""

import sys

from zipage_jax.cli import main

sys.exit(main(["crosscheck", *sys.argv[1:]]))
