"""Hypothesis profiles, one for every test: `ci` (the default) and `dev`, chosen by
`HYPOTHESIS_PROFILE`.

- `ci`: derandomized, so a run tests the same examples on every machine and a red CI is red
  again on a laptop; the budget keeps the unit lane fast.
- `dev`: ten times the examples, a fresh random draw each run and the local example database,
  for a deeper search before a change lands: `HYPOTHESIS_PROFILE=dev make unit`.

Both print the reproduction blob of a failing example and set no deadline: examples run the
worker on a shared 2-core machine, where one example's time says nothing about the code.

A test states its budget relative to the profile's (`examples(0.6)`: 60 in `ci`, 600 in
`dev`), and in its own `settings` only what is particular to it (health checks, phases, steps).
"""

from __future__ import annotations

import os
from typing import Final

from hypothesis import settings

#: The example budget of a test of weight 1 in `ci`.
CI_EXAMPLES: Final = 100
#: How much deeper `dev` searches.
DEV_DEPTH: Final = 10

settings.register_profile(
    "ci", max_examples=CI_EXAMPLES, derandomize=True, deadline=None, print_blob=True
)
settings.register_profile(
    "dev", max_examples=CI_EXAMPLES * DEV_DEPTH, derandomize=False, deadline=None, print_blob=True
)


def load() -> str:
    """Load the profile `HYPOTHESIS_PROFILE` names (`ci` when unset); return its name."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name


def examples(weight: float) -> int:
    """A test's example budget: `weight` times the loaded profile's base budget."""
    return max(1, round(weight * settings().max_examples))
