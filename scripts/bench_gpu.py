"""The GPU run: `python scripts/bench_gpu.py [flags]` is `zipage-jax bench gpu [flags]` (see its --help).

It needs the package importable: `pip install -e .` once in the checkout, or, without installing,
`python -m zipage_jax bench gpu [flags]` from the repository root.
"""

import sys

from zipage_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "gpu", *sys.argv[1:]]))
