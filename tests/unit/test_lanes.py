from tests.lanes import lane_environment


def test_lanes_may_write_bytecode_and_keep_the_rest_of_the_environment() -> None:
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/mine", "HOME": "/h"}
    assert lane_environment(environ) == {"PYTHONPYCACHEPREFIX": "/mine", "HOME": "/h"}
    assert environ["PYTHONDONTWRITEBYTECODE"] == "1"  # the caller's own is left as it was
