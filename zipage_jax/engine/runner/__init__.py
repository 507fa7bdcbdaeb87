"""The runner: the one door to the device (model_runner.py) and what it needs.

Its inputs, assembled on the host from the scheduler's output: inputs.py (a forward step's rows),
sampling_batch.py (their sampling rows), compaction.py (a compaction's tables). The programs it
runs: forward.py (the forward program's stages) and steps.py (compaction, history seeding, the device
state they donate). What gets compiled, and when: grid.py (the programs and their shape buckets),
programs.py (building one), executable_store.py (kept on disk), warmup.py (building the grid
ahead). What it hands back: results.py (host-only types, applied by the scheduler).
"""
