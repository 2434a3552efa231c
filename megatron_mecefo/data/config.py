"""Data configuration: which tokenized corpus to train on (or the embedded demo corpus) and how to
split and cache it. Pure dataclass; no torch, no megatron."""

from __future__ import annotations

import dataclasses
import re


def parse_split(split: str) -> list[float]:
    """Parse "train,valid[,test]" weights; `ValueError` unless train and valid are both positive."""
    parts = [p.strip() for p in split.split(",")]
    if not 2 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", p) for p in parts):
        raise ValueError(
            f"split {split!r} must look like '98,2' or '949,50,1' (train,valid[,test])"
        )
    weights = [float(p) for p in parts]
    if weights[0] <= 0 or weights[1] <= 0:
        raise ValueError(f"split {split!r} needs a positive train and validation share")
    return weights


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Where the training tokens come from."""

    path: str | None = None
    """Prefix of a `.bin/.idx` pair written by `tools/preprocess_data.py` (without the suffix).
    None: use the embedded synthetic demo corpus (generated once into `demo_dir`)."""
    tokenizer_model: str | None = None
    """The sentencepiece `.model` the data was tokenized with; required when `path` is set."""
    demo_dir: str = ".cache/demo_data"
    """Where the demo corpus, its tokenizer and index are generated once and reused; regenerated
    when missing, incomplete, or made with other demo settings."""
    demo_num_documents: int = 8000
    """Documents in the demo corpus (about 510 bytes and 130 tokens each)."""
    demo_seed: int = 1234
    """Seed of the demo source (its word list and transitions) and of the sampled documents."""
    demo_vocab_size: int = 512
    """Vocabulary of the sentencepiece tokenizer trained on the demo corpus."""
    split: str = "98,2"
    """Document split weights "train,valid[,test]" (Megatron's; contiguous document ranges)."""
    cache_dir: str | None = None
    """Where Megatron caches the GPTDataset index arrays; every rank must see it. None:
    `<demo_dir>/index_cache` for the demo, else `index_cache/` next to the data files."""
    eod_mask_loss: bool = False
    """Exclude the loss on predicting the end-of-document token."""

    def __post_init__(self) -> None:
        if self.path is not None and not self.path:
            raise ValueError("path must be a .bin/.idx prefix or null for the demo corpus")
        if self.path is not None and not self.tokenizer_model:
            raise ValueError(
                "tokenizer_model is required when path is set (the .model file that "
                "tools/preprocess_data.py wrote next to the .bin/.idx)"
            )
        if self.path is None and self.tokenizer_model is not None:
            raise ValueError(
                "tokenizer_model is only used with path; the demo corpus trains its own tokenizer"
            )
        for suffix in (".bin", ".idx"):
            if self.path is not None and self.path.endswith(suffix):
                raise ValueError(f"path is a prefix: drop the {suffix!r} suffix from {self.path!r}")
        if self.demo_num_documents < 50:
            raise ValueError(f"demo_num_documents must be >= 50, got {self.demo_num_documents}")
        if not 64 <= self.demo_vocab_size <= 4096:
            raise ValueError(f"demo_vocab_size must be in [64, 4096], got {self.demo_vocab_size}")
        parse_split(self.split)
