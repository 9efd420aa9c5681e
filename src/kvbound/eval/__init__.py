"""Measurement: perplexity under a bounded cache, needle retrieval, engine benchmarks, plots."""
