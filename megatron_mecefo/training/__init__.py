"""Thin trainer: `build_engine` + one readable `train_step` + a loop with hook points."""
