from tests.lanes import lane_environment
from worker.dev.sim.hash_seed import SIM_HASH_SEED


def test_lanes_may_write_bytecode_and_keep_the_rest_of_the_environment() -> None:
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/mine", "HOME": "/h"}
    assert lane_environment(environ) == {
        "PYTHONPYCACHEPREFIX": "/mine",
        "HOME": "/h",
        "PYTHONHASHSEED": SIM_HASH_SEED,
    }
    assert environ["PYTHONDONTWRITEBYTECODE"] == "1"  # the caller's own is left as it was


def test_lanes_run_under_the_simulations_hash_seed_whatever_the_caller_set() -> None:
    assert lane_environment({"PYTHONHASHSEED": "random"})["PYTHONHASHSEED"] == SIM_HASH_SEED
