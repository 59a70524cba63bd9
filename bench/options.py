"""Command-line options every benchmark program takes. Imports nothing beyond the
standard library: bench.plan_core runs inside vLLM's environment too."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_RESULTS = Path(__file__).parent / "results"
QUICK_ENV = "KVPLAN_BENCH_QUICK"
RESULTS_ENV = "KVPLAN_BENCH_RESULTS"


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get(QUICK_ENV, "") not in ("", "0"),
        help=f"smoke-test scale: small counts, short slices (env {QUICK_ENV}=1)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"folder for the .json and .md results (env {RESULTS_ENV}; default bench/results, "
        "or bench/results/quick in quick mode, which git ignores)",
    )


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then resolve the results folder: a smoke run never overwrites the figures."""
    args = parser.parse_args(argv)
    if args.results is None:
        from_env = os.environ.get(RESULTS_ENV)
        quick_folder = DEFAULT_RESULTS / "quick" if args.quick else DEFAULT_RESULTS
        args.results = Path(from_env) if from_env else quick_folder
    return args
