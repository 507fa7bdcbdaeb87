"""Evaluations (`zipage-jax eval NAME`): each module has add_arguments(parser) and run(args) -> int,
and runs through the public engine API (the run record, timing and output: zipage_jax/harness.py);
datasets.py holds every data set with its dev / held-out split. Benchmarks may import these
modules, never the reverse."""

SUBCOMMANDS = {
    "quality": "perplexity of compressed KV against full KV on texts and reasoning traces",
    "long-prompt": "pass keys and questions at the end of long prompts under a KV budget",
    "code": "HumanEval pass@1, full KV against compressed",
    "math": "GSM8K / MATH-500 pass@1 and peak KV, full KV against compressed",
    "int4-keys": "int4 keys' error on real activations, per channel against per token",
}
