"""Benchmarks of lowbit-compile: training quality against fp32 AdamW and peers, state-storage checks."""
