"""A seed's history is the seed's alone: not what ran before it in the same process."""

from __future__ import annotations

from worker.dev.sim.run import flag_set_scenario, run


def test_a_seed_whose_killed_processes_leave_generations_behind_replays_in_one_process() -> None:
    # Engines killed mid-generation leave tasks that wait on nothing; when the cyclic collector
    # closed them depended on the allocations of the runs before (the second run of this seed
    # in one process gave another history until collection was held off during a run).
    scenario = flag_set_scenario("hostile", 700001, 1)

    first = run(scenario)
    second = run(scenario)

    assert any(e.kind == "kill" for e in first.history.events)
    assert first.digest == second.digest
