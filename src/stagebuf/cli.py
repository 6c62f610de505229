"""Command line: ``stagebuf doctor``, ``stagebuf demo``, ``stagebuf bench``."""

from __future__ import annotations

import logging
import sys

import click


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Show stagebuf's log lines.")
def main(verbose: bool) -> None:
    """Host-to-device staging buffers: probe, demo and benchmark."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


@main.command()
@click.option("--device", default=None, help="Device to probe (default: current accelerator, else cpu).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(device: str | None, as_json: bool) -> None:
    """Report pinned memory, UVA and the chosen tier, with a reason and fix for each 'no'.

    A setting that cannot work here (STAGEBUF_TIER, --device) is explained, with the
    allowed values and the fix, and the exit status is 2.
    """
    from . import doctor as d

    code = d.run(device, as_json)
    if code:
        sys.exit(code)


@main.command()
@click.option("--steps", default=5, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--device", default=None)
def demo(steps: int, device: str | None) -> None:
    """Stage a few steps of engine inputs and say which tier moved them.

    Exit status: 0 when every step arrived intact, 1 on a mismatch, 2 when a
    setting (STAGEBUF_TIER, --device) cannot work here (explained as by doctor).
    """
    from . import doctor as d
    from .demo import run

    found = d.diagnose(device)
    if isinstance(found, d.Problem):
        click.echo(d.render_problem_text(found, "stagebuf demo"))
        sys.exit(d.EXIT_SETUP)
    sys.exit(1 if run(steps=steps, device=device) else 0)


def _register_bench() -> None:
    try:
        from .bench import bench
    except ImportError:  # pragma: no cover - bench is part of the package
        return
    main.add_command(bench)


_register_bench()
