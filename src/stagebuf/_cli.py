"""Command line: ``stagebuf doctor``, ``stagebuf demo`` and, from a checkout, ``stagebuf bench``.

Built on argparse, so the command line needs nothing beyond what ``import stagebuf``
needs; ``rich`` (the ``cli`` extra) only draws doctor's table.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE = 2


def _int_in(lo: int, hi: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is not in [{lo}, {hi}]")
        return v

    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="stagebuf", description="Host-to-device staging buffers: probe, demo and benchmark."
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="Show stagebuf's log lines.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "doctor",
        help="What this machine can do, the tier chosen, and why.",
        description="Report pinned memory, UVA and the chosen tier, with a reason and a fix for each "
        "'no'. A setting that cannot work here (STAGEBUF_TIER, --device) is explained, with the "
        "allowed values and the fix, and the exit status is 2.",
    )
    d.add_argument("--device", default=None, help="Device to probe (default: current accelerator, else cpu).")
    d.add_argument("--json", dest="as_json", action="store_true", help="Print the report as JSON.")
    m = sub.add_parser(
        "demo",
        help="Stage a few steps of engine inputs and say which tier moved them.",
        description="Exit status: 0 when every step arrived intact, 1 on a mismatch, 2 when a setting "
        "(STAGEBUF_TIER, --device) cannot work here (explained as by doctor).",
    )
    m.add_argument("--steps", type=_int_in(1, 10_000), default=5, help="Steps to stage (default: 5).")
    m.add_argument("--device", default=None)
    sub.add_parser(
        "bench",
        help="The benchmark harness (benchmarks/ of a checkout): stagebuf bench --help.",
        add_help=False,
    )
    return ap


def _bench(argv: Sequence[str]) -> int:
    """Run ``benchmarks/bench.py`` of the checkout this package is installed from (editable)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "bench.py").is_file():
        print(
            "stagebuf bench: the benchmark harness is not part of the installed package; it lives in "
            "the repository's benchmarks/. From a checkout: pip install -e '.[bench]', then "
            "stagebuf bench (or python -m benchmarks)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from benchmarks.bench import bench
    except ImportError as e:  # click, rich: the bench extra
        print(f"stagebuf bench needs the bench extra (pip install -e '.[bench]'): {e}", file=sys.stderr)
        return EXIT_USAGE
    bench.main(args=list(argv), prog_name="stagebuf bench")  # exits (click's standalone mode)
    return 0  # pragma: no cover


def main(argv: Sequence[str] | None = None) -> int:
    """The ``stagebuf`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    verbose = bool(args) and args[0] in ("-v", "--verbose")
    rest = args[1:] if verbose else args
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if rest and rest[0] == "bench":
        return _bench(rest[1:])
    ns = _parser().parse_args(args)
    from . import _doctor as d

    if ns.command == "doctor":
        return d.run(ns.device, ns.as_json)
    from ._demo import run

    found = d.diagnose(ns.device)
    if isinstance(found, d.Problem):
        print(d.render_problem_text(found, "stagebuf demo"))
        return d.EXIT_SETUP
    return 1 if run(steps=ns.steps, device=ns.device) else 0
