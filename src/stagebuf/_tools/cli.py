"""Command line: ``stagebuf doctor`` and ``stagebuf --version``, on argparse, so it needs nothing beyond
``import stagebuf``; ``rich`` (the ``cli`` extra) only draws doctor's table."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .. import __version__
from . import doctor as _doctor


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="stagebuf", description="Host-to-device staging buffers: what this machine can do, and why."
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="Show stagebuf's log lines.")
    ap.add_argument("-V", "--version", action="version", version=f"stagebuf {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "doctor",
        help="What this machine can do, the tier chosen, and why.",
        description="Report pinned memory, UVA and the chosen tier, with a reason and a fix for each "
        "'no', every setting, the vLLM plugin (every binding it replaces) and nano-vllm (whether it "
        "imports). A setting that cannot work (any STAGEBUF_* setting, --device) is explained, with the "
        "allowed values and the fix, and the exit status is 2: a value that is not valid is named as one, "
        "and a valid one this machine cannot serve as that.",
    )
    d.add_argument("--device", default=None, help="Device to probe (default: current accelerator, else cpu).")
    d.add_argument("--json", dest="as_json", action="store_true", help="Print the report as JSON.")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The ``stagebuf`` command; returns the exit status (2: a usage error, or a setting that cannot work)."""
    ns = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return _doctor.run(ns.device, ns.as_json)
