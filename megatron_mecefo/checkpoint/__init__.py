"""Disk checkpoints: megatron `dist_checkpointing` (torch_dist format) step folders with a commit
marker written last, checksums validated before use, keep-latest-k, async save, exact resume.

`layout` is the pure on-disk protocol (no torch); `manager` is the loop hook; the megatron calls
live in `megatron_mecefo.mcore.checkpointing`.
"""
