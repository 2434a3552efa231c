"""Metrics: metrics.jsonl / events.jsonl, TensorBoard and W&B sinks, progress output, MFU."""
