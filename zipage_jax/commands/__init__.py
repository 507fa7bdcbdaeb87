"""The console script's own subcommands (zipage_jax/cli.py): generate and serve."""
