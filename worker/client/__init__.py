"""The trainer's side: `RolloutClient` (jobs out, results back over Kafka), the fleet handle,
the RL loop. Needs aiokafka and `schemas`, never vLLM."""

from worker.client.conversation import Conversation, ConversationError
from worker.client.rollout import RolloutClient, RolloutError
from worker.core.tracing import TraceContextError

__all__ = [
    "Conversation",
    "ConversationError",
    "RolloutClient",
    "RolloutError",
    "TraceContextError",
]
