#!/usr/bin/env python
"""Tokenize a corpus into a Megatron indexed dataset (.bin/.idx) plus a sentencepiece tokenizer.

Examples:
  # train a 8192-piece tokenizer on your text and index it
  python tools/preprocess_data.py --input corpus.jsonl --json-key text --output-prefix data/my \\
      --vocab-size 8192
  # reuse an existing tokenizer
  python tools/preprocess_data.py --input more.txt --output-prefix data/more \\
      --tokenizer-model data/my.model
  # write the synthetic demo corpus as text (and index it, with --output-prefix)
  python tools/preprocess_data.py --make-demo-corpus data/demo.txt --output-prefix data/demo \\
      --vocab-size 512

Then train with `data.path=<output-prefix> data.tokenizer_model=<output-prefix>.model`.
A user error prints one `error: ...` line and exits with the code from megatron_mecefo.errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mecefo.errors import ExitCode, MecefoError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(
            "Train a sentencepiece tokenizer on text/JSONL files (or reuse one) and write a "
            "Megatron-Core indexed dataset: <output-prefix>.bin/.idx, one document per line or "
            "JSONL record, an end-of-document token appended to each. Outputs appear only when "
            "complete (temporary names, renamed at the end)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--input",
        nargs="+",
        metavar="FILE",
        help="input files: .txt (one document per line) or .jsonl/.json (one JSON object per line)",
    )
    p.add_argument(
        "--output-prefix",
        metavar="PREFIX",
        help="write PREFIX.bin, PREFIX.idx and (when a tokenizer is trained) PREFIX.model",
    )
    p.add_argument("--json-key", default="text", help="JSONL field that holds the document text")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="vocabulary of the trained tokenizer (special pieces included); the model's "
        "vocab_size must be at least this",
    )
    p.add_argument(
        "--tokenizer-model",
        metavar="MODEL",
        help="reuse this sentencepiece .model instead of training one (--vocab-size is ignored)",
    )
    p.add_argument(
        "--model-type",
        choices=["unigram", "bpe"],
        default="unigram",
        help="sentencepiece algorithm for a trained tokenizer",
    )
    p.add_argument(
        "--byte-fallback",
        action="store_true",
        help="encode characters outside the tokenizer's alphabet as bytes (uses 256 pieces)",
    )
    p.add_argument(
        "--make-demo-corpus",
        metavar="TXT",
        help="write the synthetic demo corpus (word-level Markov source, known entropy) to TXT, "
        "one document per line; with --output-prefix it is then indexed like an --input",
    )
    p.add_argument(
        "--demo-num-documents", type=int, default=8000, help="documents for --make-demo-corpus"
    )
    p.add_argument("--demo-seed", type=int, default=1234, help="seed for --make-demo-corpus")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def run(args: argparse.Namespace) -> None:
    from megatron_mecefo.data.preprocess import preprocess
    from megatron_mecefo.errors import ConfigError

    inputs = list(args.input or [])
    if args.make_demo_corpus:
        _write_demo(args)
        inputs.append(args.make_demo_corpus)
        if not args.output_prefix:
            return
    if not inputs:
        raise ConfigError("nothing to do: pass --input FILE [FILE ...] or --make-demo-corpus TXT")
    if not args.output_prefix:
        raise ConfigError("--output-prefix is required to write a dataset")
    if args.tokenizer_model is None and args.vocab_size < 16:
        raise ConfigError(f"--vocab-size must be >= 16, got {args.vocab_size}")
    t0 = time.perf_counter()
    result = preprocess(
        inputs,
        args.output_prefix,
        vocab_size=args.vocab_size,
        tokenizer_model=args.tokenizer_model,
        json_key=args.json_key,
        model_type=args.model_type,
        byte_fallback=args.byte_fallback,
        progress=not args.quiet,
    )
    print(
        f"wrote {result.output_prefix}.bin/.idx: {result.num_documents} documents, "
        f"{result.num_tokens} tokens, vocab {result.vocab_size} ({time.perf_counter() - t0:.1f} s)"
    )
    print(
        f"train with: data.path={result.output_prefix} "
        f"data.tokenizer_model={result.tokenizer_model} (model vocab_size >= {result.vocab_size})"
    )


def _write_demo(args: argparse.Namespace) -> None:
    from megatron_mecefo.data.synthetic import MarkovSource, MarkovSourceSpec

    source = MarkovSource(MarkovSourceSpec(seed=args.demo_seed))
    docs = source.generate(args.demo_num_documents, seed=args.demo_seed)
    out = args.make_demo_corpus
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for doc in docs:
            f.write(doc.text + "\n")
    os.replace(tmp, out)
    symbols = sum(d.num_words + 1 for d in docs)
    print(
        f"wrote {out}: {len(docs)} documents, {symbols - len(docs)} words; source entropy rate "
        f"{source.entropy_rate():.4f} nats/word (a word or an end-of-document per symbol)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core warns at import that TE/Apex are absent: irrelevant to preprocessing.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        run(args)
    except MecefoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; no partial output was left", file=sys.stderr)
        return int(ExitCode.FAILURE)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
