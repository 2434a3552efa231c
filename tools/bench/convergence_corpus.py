"""The convergence benchmark's corpora: Debian's fortunes or the King James Bible, one document
per line, tokenized and indexed (`tools/preprocess_data.py`).

Imported by `convergence.py`, which puts `tools/bench` and the repository on `sys.path`."""

from __future__ import annotations

from pathlib import Path

FORTUNES_DIR = Path("/usr/share/games/fortunes")


def prepare_fortunes(corpus_dir: str) -> list[str]:
    """Write the fortunes as one document per line, index them; return data overrides."""
    out = Path(corpus_dir)
    prefix = out / "fortunes"
    if not (out / "fortunes.idx").exists():
        if not FORTUNES_DIR.is_dir():
            raise SystemExit(
                f"error: {FORTUNES_DIR} not found: install Debian's fortunes package "
                "(apt-get install fortunes) or use --corpus demo"
            )
        docs = []
        for path in sorted(FORTUNES_DIR.iterdir()):
            if path.suffix or not path.is_file():  # skip .dat / .u8 index files and links
                continue
            text = path.read_text(encoding="utf-8", errors="ignore")
            docs += [" ".join(d.split()) for d in text.split("\n%\n") if d.strip()]
        _preprocess(out, "fortunes", docs)
    return [f"data.path={prefix}", f"data.tokenizer_model={prefix}.model"]


def prepare_kjv(corpus_dir: str) -> list[str]:
    """The King James Bible (Debian's bible-kjv: `bible -f`), one chapter per document."""
    import shutil
    import subprocess

    out = Path(corpus_dir)
    prefix = out / "kjv"
    if not (out / "kjv.idx").exists():
        if shutil.which("bible") is None:
            raise SystemExit(
                "error: the `bible` command was not found: install Debian's bible-kjv package "
                "(apt-get install bible-kjv) or use --corpus demo"
            )
        text = subprocess.run(
            ["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True, timeout=120
        ).stdout
        chapters: dict[str, list[str]] = {}
        for line in text.splitlines():
            ref, _, verse = line.partition(" ")
            if verse:
                chapters.setdefault(ref.split(":")[0], []).append(verse.strip())
        docs = [" ".join(v) for v in chapters.values()]
        if len(docs) < 1000:
            raise SystemExit(f"error: `bible -f` gave {len(docs)} chapters, expected 1189")
        _preprocess(out, "kjv", docs)
    return [f"data.path={prefix}", f"data.tokenizer_model={prefix}.model"]


def _preprocess(out: Path, name: str, docs: list[str]) -> None:
    from preprocess_data import main as preprocess_main

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    code = preprocess_main(
        [
            "--input",
            str(out / f"{name}.txt"),
            "--output-prefix",
            str(out / name),
            "--vocab-size",
            "512",
            "--quiet",
        ]
    )
    if code:
        raise SystemExit(f"error: preprocessing the {name} corpus failed ({code})")
    print(f"{name} corpus: {len(docs)} documents -> {out / name}.bin/.idx", flush=True)


def corpus_overrides(args) -> list[str]:
    if args.corpus == "fortunes":
        return prepare_fortunes(args.corpus_dir)
    if args.corpus == "kjv":
        return prepare_kjv(args.kjv_dir)
    return []
