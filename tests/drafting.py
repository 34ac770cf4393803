"""Test helpers for ``--speculative auto``."""

from __future__ import annotations


def fixed_costs(drafter):
    """``drafter`` (an AutoDrafter) with a wider call costing 0.1 plain steps per extra token and
    no timing: tests of what verification keeps must not hang on how fast a loaded CI box ran a
    call, which decides whether auto drafts at all."""
    drafter.seconds = {w: 1 + 0.1 * (w - 1) for w in range(1, 10)}
    drafter.observe = lambda *_: None
    return drafter
