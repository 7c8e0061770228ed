"""Which worker processes are members of the group now: each process draws an incarnation at
start, announces it to the group, and names it in the offset maps it commits.

A commit that is not a clean hand-over names the records its writer was running. Whether those
records were present at a death depends on whether the writer died: a member whose hand-over
commit was refused during a rebalance (a broker that bumps the generation as soon as another
member joins does so) is alive, and its records were merely handed over. The group's member
list answers that, but a member id does not: aiokafka drops it and joins afresh after a refused
commit, and a static member restarted under its instance id is a new process with the old
name. So each process announces a random number of its own in its subscription's `user_data`
(the field the consumer protocol keeps for the assignor; round-robin ignores it), which
DescribeGroups returns with each live member's metadata.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Any, Final

from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

__all__ = ["incarnation_assignor", "incarnations_of_members", "new_incarnation"]

# `user_data` of this worker: a tag, then the incarnation as 8 bytes big-endian. The tag keeps
# another consumer's user data from being read as an incarnation.
_TAG: Final = b"vkw-incarnation:"
_BITS: Final = 48
# Group states in which Apache Kafka's DescribeGroups leaves out the members' metadata.
_REBALANCING: Final = frozenset({"PreparingRebalance", "CompletingRebalance", "AwaitingSync"})


def new_incarnation() -> int:
    """A random, non-zero number naming one worker process (0 means "not named")."""
    return secrets.randbits(_BITS) or 1


def incarnation_assignor(incarnation: int) -> type[RoundRobinPartitionAssignor]:
    """Round-robin assignment, as aiokafka's default, announcing `incarnation` to the group."""
    user_data = _TAG + incarnation.to_bytes(8, "big")

    class IncarnationAssignor(RoundRobinPartitionAssignor):  # type: ignore[misc]
        @classmethod
        def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
            return ConsumerProtocolMemberMetadata(cls.version, list(topics), user_data)

    return IncarnationAssignor


def incarnations_of_members(descriptions: Sequence[Any], group_id: str) -> set[int] | None:
    """The incarnations announced by the live members of `group_id`, from aiokafka's
    `describe_consumer_groups` responses; None while the group rebalances, when Apache Kafka
    returns its members without their metadata (`GroupMetadata.summaryNoMetadata`), so the
    answer says nothing about who is alive. None too when no member of a group that has members
    carries metadata (tansu never returns it): the asking worker is a member and announces
    itself, so that is the broker, not the members. A member whose metadata is missing
    otherwise, or holds no incarnation, names none."""
    found: set[int] = set()
    for response in descriptions:
        for group in response.to_object().get("groups", []):
            if group.get("group") != group_id or group.get("error_code"):
                continue
            if group.get("state") in _REBALANCING:
                return None
            members = group.get("members", [])
            if members and not any(member.get("member_metadata") for member in members):
                return None
            for member in members:
                raw = member.get("member_metadata") or b""
                try:
                    user_data = ConsumerProtocolMemberMetadata.decode(raw).user_data or b""
                except Exception:  # noqa: BLE001, S112 - another client's metadata: names none
                    continue
                if user_data.startswith(_TAG) and len(user_data) == len(_TAG) + 8:
                    found.add(int.from_bytes(user_data[len(_TAG) :], "big"))
    return found
