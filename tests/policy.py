"""Policy events a test plants on the ``policy`` stream: what the trainer publishes, without its lease guard
(the trainer writes ``trained`` only through :meth:`trainer.tenure.TrainerTenure.publish`)."""

from bus.messages import PolicyVersion
from bus.streams import Bus


async def publish_trained(bus: Bus, step: int) -> str:
    """Announce that step ``step``'s weights are written, as the trainer does."""
    return await bus.publish(bus.keys.policy(), PolicyVersion(role="trained", step=step))
