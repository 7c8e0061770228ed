from pathlib import Path

from tests.lanes import lane_environment


def test_lanes_write_bytecode_into_a_cache_under_the_virtualenv() -> None:
    env = lane_environment({"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/h"}, Path("/v"))
    assert env == {"HOME": "/h", "PYTHONPYCACHEPREFIX": "/v/pycache"}


def test_a_cache_the_user_named_is_kept() -> None:
    env = lane_environment({"PYTHONPYCACHEPREFIX": "/mine"}, Path("/v"))
    assert env == {"PYTHONPYCACHEPREFIX": "/mine"}


def test_outside_a_virtualenv_the_environment_is_left_alone() -> None:
    environ = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert lane_environment(environ, None) == environ
