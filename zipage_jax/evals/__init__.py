"""Evaluations that run through the public engine API (LLM, SamplingParams)."""
