"""OpenAI-compatible server: python scripts/serve_jax.py [flags] is `zipage-jax serve [flags]`."""

import sys

from zipage_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
