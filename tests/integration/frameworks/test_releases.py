"""Each recipe names the release this lane checked it against: moving a pin in
`requirements.txt` fails here until the recipe is checked again and says so."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from schemas import RECIPES

#: Recipe -> the distribution whose released code the lane runs for it.
CHECKED_BY_THIS_LANE = {"prime-rl": "verifiers", "verl": "verl", "skyrl": "skyrl"}


def pinned() -> dict[str, str]:
    lines = (Path(__file__).parent / "requirements.txt").read_text().splitlines()
    pins = (line.split("#")[0].strip() for line in lines)
    return dict(pin.split("==") for pin in pins if pin)


@pytest.mark.parametrize("recipe", sorted(CHECKED_BY_THIS_LANE))
def test_the_recipe_names_the_installed_release_it_was_checked_against(
    recipe: str, releases: Path
) -> None:
    dist = CHECKED_BY_THIS_LANE[recipe]
    assert version(dist) == pinned()[dist]
    assert f"{dist} {version(dist)}" in RECIPES[recipe].checked_against


def test_recipes_this_lane_cannot_run_say_what_they_follow() -> None:
    for recipe in set(RECIPES) - set(CHECKED_BY_THIS_LANE):
        assert "source" in RECIPES[recipe].checked_against, recipe
