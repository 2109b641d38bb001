"""Verbs of a run's lane go to the replica that owns the lane (issue 32; docs/replicas.md).

``@on_lane_owner`` wraps the verbs whose answer depends on the lane's state in memory: the
sequenced ones (forward_backward, forward, optim_step, save_weights, load_weights), AbandonSeq, and
GetInfo (its next seq is the lane's queue's). With one scheduler (SoleOwner) it only calls the verb.
With replicas the run is looked up first (another tenant's run answers NOT_FOUND here, before any
hop); its lane held here: the verb runs here; held by another live replica: forwarded there;
held by nobody right now: UNAVAILABLE, and the client resends. Sampling needs no order and is
served by whichever replica gets it.

With replicas, the answer names the lane's owner in trailing metadata ``temper-lane-owner`` (this
replica's advertised address when the verb ran here, the owner's when it was forwarded), so clients
send the run's next lane verbs there themselves (common/owner_hints.py). It rides errors too (the
ErrorInterceptor's abort keeps trailing metadata set before it) once the owner is known: a verb's
own refusal names the owner, while a lookup's NOT_FOUND, a second hop's UNAVAILABLE and a forward
that failed name nobody (the owner may be gone).
"""

from __future__ import annotations

import functools

from temper.common.errors import TemperError, Unavailable
from temper.common.owner_hints import LANE_OWNER
from temper.scheduler.cluster.forwarding import forwarded_from, not_forwarded_twice
from temper.scheduler.tenancy.auth import caller


def on_lane_owner(method):
    @functools.wraps(method)
    async def wrapper(self, request, context):
        if not self.ownership.replicated:
            return await method(self, request, context)
        await self.backends.wait_ready()
        run = await self.runs.get(request.training_run_id, caller())
        lane = self.backends.trainer_for(run.base_model, run.run_id).address
        address = await self.ownership.route(lane)
        if address is None:
            context.set_trailing_metadata(((LANE_OWNER, self.ownership.address),))
            return await method(self, request, context)
        sender = forwarded_from(context)
        if sender is not None:
            self._forget_route(run.run_id)
            raise not_forwarded_twice(lane, sender)
        try:
            answer = await self.forwarder.forward(address, method.__name__, request, context)
        except Unavailable:
            self._forget_route(run.run_id)  # its placement or owner may have changed: read again next time
            raise
        except TemperError:
            context.set_trailing_metadata(((LANE_OWNER, address),))  # the owner answered: it is there
            raise
        context.set_trailing_metadata(((LANE_OWNER, address),))
        return answer

    return wrapper


class LaneRouting:
    """The servicer's part: who decides (``ownership``) and who carries (``forwarder``)."""
    ownership = None
    forwarder = None

    def _forget_route(self, run_id: str) -> None:
        if self.runs.known(run_id) is not None and not self.ownership.holds(self.backends.placements.get(run_id, "")):
            self.runs.forget(run_id)
            self.backends.placements.pop(run_id, None)
