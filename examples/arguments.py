"""Argument types the example scripts share: counts refused on the command line, before any process starts."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """A count (steps, micro-batches, pairs), refused below 1 before launch: Lightning would fail in each process."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def processes(text: str) -> str:
    """``--devices``: a number of processes (at least 1), or what Lightning reads itself ('auto', '-1', '0,1')."""
    if text in ("0", "-0") or (text.startswith("-") and text != "-1"):
        raise argparse.ArgumentTypeError(f"must be a number of processes (at least 1) or 'auto', got {text}")
    return text

