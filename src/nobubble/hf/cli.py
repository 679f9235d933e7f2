"""``nobubble export RUN_FOLDER OUT --format hf [--step N] [--version newest|N]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from nobubble.config.fields import NON_NEGATIVE
from nobubble.config.flags import whole
from nobubble.destinations import check_output_folder
from nobubble.hf.export import Version


def _version(text: str) -> Version:
    if text == "newest":
        return "newest"
    try:
        number = int(text)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a weight version: give 'newest' or a number N >= 0 (the weights "
            "after N updates)"
        )
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN_FOLDER", help="the run folder to export from")
    parser.add_argument("out", metavar="OUT", help="a new (or empty) folder to write")
    parser.add_argument(
        "--format",
        choices=["hf"],
        default="hf",
        help="hf: a Hugging Face LlamaForCausalLM folder (safetensors, config, tokenizer)",
    )
    parser.add_argument(
        "--step",
        type=whole(NON_NEGATIVE),
        metavar="N",
        help="export the checkpoint of step N (default: the newest valid checkpoint)",
    )
    parser.add_argument(
        "--version",
        type=_version,
        default="newest",
        metavar="newest|N",
        help="weight version: the newest (default) or N, the weights after N updates (2bw and "
        "pipedream checkpoints also hold older, stashed versions)",
    )


def run(args: argparse.Namespace) -> int:
    from nobubble.hf.export import export_hf, provenance

    # made beside OUT and renamed into place
    check_output_folder(args.out, "OUT", whole=True)
    out = export_hf(Path(args.run), Path(args.out), step=args.step, version=args.version)
    source = provenance(out)
    newest = " (the newest)" if source["version"] == source["newest_version"] else ""
    print(
        f"exported {source['checkpoint']} of {args.run}, weight version {source['version']}"
        f"{newest}, to {out} (LlamaForCausalLM; load it with "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))"
    )
    return 0
