"""hivemind's matchmaking kept alive through a cancelled step.

hivemind's `DecentralizedAverager._step` cancels its matchmaking task when a step is cancelled
and returns without awaiting it. asyncio holds running tasks only weakly, and hivemind's
`MPFuture` registry holds its futures weakly too. The cancelled task's cleanup awaits a DHT
store (`_declare_averager_periodically` withdraws its declaration: an MPFuture). While it waits,
nothing holds the chain strongly, so the cycle collector may destroy it halfway ("Task was
destroyed but it is pending!"). Its `finally` blocks never run, and the matchmaking locks
(`lock_looking_for_group`, `lock_search`, `lock_declare`) stay held for good. Every later step
of that averager then waits for a lock and never finds a group. Seen under load: a joiner whose
first exchange was abandoned (it took a newer state) borrowed the others' average for 27 rounds
running, while they waited `round_wait` for it every round.

A cancelled step may also go on: hivemind reads the cancel signal before the step's own state says
cancelled, and then retries it ("caught CancelledError(), retrying"). That step still carries its
old round's ticket while the group key is already the next round's: it asked a leader of the next
round to take it (refused: its ticket is of another round) and split that round's group in two.

A round's target group size is the number of members that started it, and a leader holding fewer
waits out its whole declared time (min_matchmaking_time = round_wait) before it starts with what it
has. A member that leaves the round after it began (it stopped, or it takes the swarm's state) made
the others wait that long every time. `lower_target` lowers the target once the stage's membership
shows it, and a leader that already holds that many members starts its group at once.

A follower gives up on a leader's ACCEPTED after request_timeout, while a leader whose event loop
was starved (or whose join lock its own request held) may still take the request and count it in:
the group then runs with a member that never learned of it. hivemind's member waits without end
for such a group to register, and the others waited out their timeouts for its parts (a round of
15 s instead of 1, seen on 2 busy cores). Its averager answers at once instead
(`outside_every_group`): a part of that group (BAD_GROUP_ID) or a request for a compressed message
of it (gather.py); the others leave it out as sender and reducer (allreduce.py), never ask it for
the spans they miss (exchange.mending_order), and at the last round wait for it to take the final
state before they leave (swarm/worker.py, `_all_hold`).

A follower whose leader ACCEPTED it may also lose the leader's next answer: the answer stream closes
before BEGIN_ALLREDUCE (seen under load on loopback, 0.01-0.13 s after the request; the cause, below the
application, is not found yet), while the leader counted it in. `track_join_requests` records such a lost
acceptance (`lost_acceptance`), and the averager asks a member of the group whose part then reaches it which
group began (group_admission.GroupAdmission._join_begun): holding this worker, it joins that group late
instead of being left out of it and borrowing its average.

A leader that takes a request and fills its group starts the all-reduce at once, and the other
members' parts may reach the new follower before the leader's ACCEPTED does (hivemind's own
comment in `rpc_aggregate_part`). A worker whose request to a leader is still in flight is
therefore not outside every group yet: `track_join_requests` counts those requests, and the
averager waits for them to end before it answers (answered at once, a busy start's round 0 lost
a member that joined its group a moment later).

A round's target counts the members this worker expects (those that started the round and are not
suspected of having failed in an all-reduce: membership.py). A member left out of that count may still
come: a suspect that is alive after all. Accepted first, it filled the place of a member the target was
counted for, the group started without that member, and it borrowed the group's average (seen under
load, where a member starved of CPU fails as a reducer now and then). `screen_join_requests` raises the
target by one for each follower the leader did not count on, so the group waits for the members it did.

A designated leader (`DesignatedLeader`). hivemind's followers find their leader through the DHT: each
member declares itself under the round's group key, reads the others' declarations back, and asks them in
turn. With the members entering the round within a few tens of milliseconds of each other (their member
records are pushed: member_push.py), that took 0.2-0.3 s after the last one entered on loopback (2 busy
cores), and members that declared at once asked each other in a tangle. The stage worker names the round's
leader instead: the smallest peer id among the members it expects that have started the round. A follower
asks it directly, once, declaring a later expiration than the leader's (hivemind's leader takes only
followers that declared no earlier than itself: exchange.FOLLOWER_LAG_S); a request that comes before the
leader looks for the round's group waits for that (group_admission._wait_to_lead). The leader waits for
its followers for a quarter of round_wait before it searches the DHT too. Where members' views differ (a
leader that follows another, one that never comes), each falls back to hivemind's search, which finds the
leaders it found before: the designated leader declared itself with the earliest expiration.

Views that differ may make two members ask each other: each takes the other for the leader (the one a
member designates follows another, or is armed to follow), or one follows the leader it designated while that
leader, its time to lead alone up, asks it from hivemind's queue. hivemind's request holds the join lock
until the leader answers, and the leader's handler of a request waits for that lock: both waited out
request_timeout (5 s), then each handler took the other's request that its sender had given up on (a
member counted into a group it never learnt of). hivemind's own queue never asks a member that declared a
later expiration, so this never happens to it. A request from a member this worker is itself asking to lead
it is refused at once by the one of the two that hivemind's order makes the follower (the later expiration:
`refuses_mutual_ask`, group_admission.py): the other's request ends, and its handler takes the refused one
in. Both refusing sent each on to its next leader, and hivemind's search never asks a leader twice: the two
waited out their whole declared time alone. (Seen on 2 busy cores: two of three members stranded a round
after a 5 s mutual wait, test_elastic.)

hivemind's queue of leaders (`PotentialLeaders`) reads the round's declarations from the DHT again only while the
leader at its top is due before this worker's search ends. A member that declared itself after the last read, and
earlier than this worker, then went unseen for the whole round: with the designated leader following (fault
injection), one of the two others never saw the other, which, due first, waited to be asked; the one held the third
as its follower, and all three waited out round_wait and stranded the round (test_elastic beside a busy core, 3 runs
in 22). `pop_while_unsure`
reads the queue again every UNSURE_POLL_S while a leader due before this worker could still declare itself
(`may_meet_an_earlier_leader`); only a search that falls back to hivemind's queue reads it (a round that forms
around its designated leader reads nothing).

hivemind's queue also reads the declarations again at once whenever it holds no leader to ask (or only later ones):
`pop_next_leader` sets `update_triggered`, the read ends, and the next pop sets it again, a loop at the DHT's round
trip for as long as no leader comes. A member waiting for a late one sent each other node over 100 finds a second,
refused past the DHT's limit (hivemind_patches.DHT_REQUESTS_PER_S), for seconds (CI: test_lost_step's round after
the lost one). `space_queue_reads` spaces those reads QUEUE_READ_S apart.

`hold_matchmaking_tasks` keeps a strong reference to each task inside `look_for_group` until it
has finished, so a cancelled search always unwinds and releases its locks; and a step that is
not the one prepared last (`stale(step)`) finds no group at once instead of looking.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import InvalidStateError
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from . import join_reasons

__all__ = ["DesignatedLeader", "abandon_begun_groups", "asked_leaders", "asking", "cancel_step", "drop_stale_searches", "forget_lost_acceptance", "hold_matchmaking_tasks", "joining", "looking_for_group",
           "lost_acceptance", "lower_target", "pop_while_unsure",
           "outside_every_group", "refuses_mutual_ask", "screen_join_requests", "set_target_size", "space_queue_reads",
           "track_join_requests"]

logger = logging.getLogger(__name__)

ASKED_KEPT = 32  # leaders asked, kept for asked_leaders
UNSURE_POLL_S = 0.25  # hivemind's leader queue is read again this often while an earlier leader may still declare
LEAD_POLL_S = 0.05  # a designated leader looks this often whether its time to lead alone is up (no network)
QUEUE_READ_S = 0.2  # hivemind's leader queue is read from the DHT at most this often (space_queue_reads)


class DesignatedLeader:
    """The member a round's group forms around (module docstring), as hivemind's leader queue sees it."""

    def __init__(self) -> None:
        self.leader, self.me, self.until, self.asked = "", "", 0.0, False

    def set(self, leader: str, me: str, lead_s: float) -> None:
        """This round's leader is `leader` ("" none); this worker is `me`; a leader waits `lead_s` for followers."""
        self.leader, self.me, self.until, self.asked = leader, me, time.monotonic() + lead_s, False

    async def next(self) -> PeerID | None:
        """Called where hivemind's search takes its next leader: a follower's first is the designated leader; a
        designated leader waits (asks nobody) until its time to lead alone is up; then None: hivemind's queue."""
        while self.leader and self.leader == self.me and (left := self.until - time.monotonic()) > 0:
            await asyncio.sleep(min(LEAD_POLL_S, left))
        if self.leader and self.leader != self.me and not self.asked:
            self.asked = True
            return PeerID.from_base58(self.leader)
        return None


async def pop_while_unsure(leaders: Any, pop: Callable[[], Awaitable[PeerID]]) -> PeerID:
    """hivemind's `pop` of its leader queue `leaders` (PotentialLeaders), the queue read again from the DHT every
    UNSURE_POLL_S while a leader due before this worker could still declare itself (module docstring)."""
    popping = asyncio.ensure_future(pop())
    try:
        while True:
            done, _ = await asyncio.wait({popping}, timeout=UNSURE_POLL_S)
            if done:
                return popping.result()
            if may_meet_an_earlier_leader(leaders):
                leaders.update_triggered.set()
    finally:
        popping.cancel()


def may_meet_an_earlier_leader(leaders: Any) -> bool:
    """Whether a member that declares itself now could still be due before this worker (hivemind's PotentialLeaders
    `leaders`): one declares at least min_matchmaking_time ahead, less the DHT's allowed clock discrepancy. (hivemind's
    own `max_assured_time` also counts the expirations it has read, which say nothing of members it has not.)"""
    soonest = get_dht_time() + leaders.min_matchmaking_time - MAX_DHT_TIME_DISCREPANCY_SECONDS
    return soonest < leaders.declared_expiration_time


def space_queue_reads(key_manager: Any, interval: float = QUEUE_READ_S) -> None:
    """Wrap hivemind's `key_manager.get_averagers` (GroupKeyManager, once): each read of the leaders' declarations
    begins at least `interval` after the last one began (module docstring); a first read after a pause, at once."""
    if getattr(key_manager, "_dilocox_spaced", False):
        return
    get, last = key_manager.get_averagers, [-float("inf")]

    async def spaced(*args: Any, **kwargs: Any) -> Any:
        wait = last[0] + interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last[0] = time.monotonic()
        return await get(*args, **kwargs)

    key_manager.get_averagers = spaced
    key_manager._dilocox_spaced = True


def hold_matchmaking_tasks(
    matchmaking: Any, stale: Callable[[Any], bool], reused: Callable[[Any], Any] = lambda step: None,
) -> dict[asyncio.Task, Any]:  # fmt: skip
    """Wrap `matchmaking.look_for_group` (once) so that the task running it is held until it finishes, a
    `stale` step (hivemind's StepControl) is cancelled and finds no group (cancelled, hivemind's step does not
    retry it), and a step for which `reused(step)` names a group (hivemind's GroupInfo: group_reuse.py) takes it
    without looking; returns the held tasks, each with its step (`drop_stale_searches`)."""
    held: dict[asyncio.Task, Any] | None = getattr(matchmaking, "_dilocox_held_tasks", None)
    if held is not None:
        return held
    held = {}
    look_for_group = matchmaking.look_for_group

    async def look_for_group_held(step: Any, *args: Any, **kwargs: Any) -> Any:
        if stale(step):
            logger.debug("a step of an earlier round looked for a group again; it is cancelled")
            cancel_step(step)
            return None
        task = asyncio.current_task()
        if task is not None:
            held[task] = step
            task.add_done_callback(lambda done: held.pop(done, None))
        # held also with a reused group: hivemind's step may then still await its trigger (an MPFuture, held weakly
        # by hivemind), and the step's task chain, unreachable, was collected halfway: the step never ended
        group = reused(step)
        if group is None:
            group = await look_for_group(step, *args, **kwargs)
        if group is not None:
            assembled.append(group.group_id)
        return group

    assembled: collections.deque[bytes] = collections.deque(maxlen=8)
    matchmaking.look_for_group = look_for_group_held
    matchmaking._dilocox_held_tasks = held
    matchmaking._dilocox_assembled = assembled
    return held


def drop_stale_searches(matchmaking: Any, stale: Callable[[Any], bool]) -> int:
    """Cancel every search still looking for a group with a `stale` step (one of an earlier round); returns how
    many. Called when a round is prepared: a step of an earlier round that hivemind retried went on looking
    under the new round's group key with its old round's ticket, which every leader refuses, and held the
    matchmaking lock that the new round's step waited for (both stranded a round after a resync, seen in the
    pair split test)."""
    dropped = 0
    for task, step in list(getattr(matchmaking, "_dilocox_held_tasks", {}).items()):
        if not task.done() and not task.cancelling() and stale(step):
            cancel_step(step)
            task.cancel()
            dropped += 1
    return dropped


def cancel_step(step: Any) -> None:
    """Cancel hivemind's StepControl. One cancelled already raises, and needs nothing: the averager process dropped
    it as stale and the host gives up on it too, or the other way round."""
    try:
        step.cancel()
    except InvalidStateError:
        logger.debug("the step was cancelled already")


_NO_GROUP = {
    False: "no group",
    # the leader took it in, then its answer stream ended before it said which group began (or that none did):
    # that leader may count this worker into a group it never learns of (seen under load on loopback)
    True: "accepted, then no group",
}


def track_join_requests(matchmaking: Any) -> None:
    """Wrap `matchmaking._request_join_group` (once) so that `joining` tells whether a request to a leader is in
    flight (a leader's redirect to another leader is a nested request, counted too), and `asked_leaders` whom the
    latest searches asked."""
    if hasattr(matchmaking, "_dilocox_asking"):
        return
    matchmaking._dilocox_asked = collections.deque(maxlen=ASKED_KEPT)
    matchmaking._dilocox_asking = collections.Counter()
    request_join_group = matchmaking._request_join_group
    _count_acceptances(matchmaking)
    join_reasons.capture()

    async def request_join_group_tracked(leader: Any, *args: Any, **kwargs: Any) -> Any:
        name = leader.to_base58()
        matchmaking._dilocox_asked.append(name)
        matchmaking._dilocox_asking[name] += 1
        asked, group, cancelled = time.monotonic(), None, False
        acceptances = matchmaking._dilocox_acceptances
        matchmaking._dilocox_dropped = False
        try:
            group = await request_join_group(leader, *args, **kwargs)
            return group
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            matchmaking._dilocox_asking[name] -= 1
            if not matchmaking._dilocox_asking[name]:
                del matchmaking._dilocox_asking[name]
            # accepted in this request (or in a leader's redirect it followed), then no group
            lost = group is None and matchmaking._dilocox_acceptances > acceptances and not matchmaking._dilocox_dropped
            if lost:
                matchmaking._dilocox_lost = True
            if group is None:  # hivemind says why at debug level only; a leader that counts it in anyway splits a round
                why = "cancelled: its search ended" if cancelled else join_reasons.take() or "no reason given"
                logger.info("asked %s to take this worker into its group: %s after %.2f s (%s)", leader,
                            _NO_GROUP[lost], time.monotonic() - asked, why)  # fmt: skip

    matchmaking._request_join_group = request_join_group_tracked


def _count_acceptances(matchmaking: Any) -> None:
    """Count the leaders' ACCEPTED answers: hivemind sets `was_accepted_to_group` at one and clears it when the request
    ends. A task waiting on that event told it only once the event loop ran it again: a request that ended in the same
    step (cancelled, or its stream closed right after ACCEPTED) was taken for one never accepted, and the worker
    that the leader counted in was left out of its group instead of joining it late (a local run of test_agreement)."""
    event = matchmaking.was_accepted_to_group
    matchmaking._dilocox_acceptances = 0
    set_event = event.set

    def set_and_count() -> None:
        matchmaking._dilocox_acceptances += 1
        set_event()

    event.set = set_and_count


def lost_acceptance(matchmaking: Any) -> bool:
    """Whether a request of this round's search was accepted by its leader and then ended without a group
    (module docstring); `forget_lost_acceptance` clears it when a round is prepared."""
    return bool(getattr(matchmaking, "_dilocox_lost", False))


def forget_lost_acceptance(matchmaking: Any) -> None:
    matchmaking._dilocox_lost = False


def abandon_begun_groups(matchmaking: Any, abandon: Callable[[], str]) -> None:
    """Wrap `matchmaking.follower_assemble_group` (once) for fault injection: where `abandon()` names
    `abandon_accepted`, a follower drops its leader's BEGIN_ALLREDUCE as if its request had timed out just before
    the leader's ACCEPTED: the leader counted it into the group, and it goes on looking, never learning of that
    group. Where it names `lose_begin`, it drops BEGIN_ALLREDUCE as a closed answer stream does: it knows it
    was accepted (`lost_acceptance`)."""
    if getattr(matchmaking, "_dilocox_abandons", False):
        return
    matchmaking._dilocox_abandons = True
    assemble = matchmaking.follower_assemble_group

    async def assemble_unless_abandoned(leader: Any, message: Any) -> Any:
        fault = abandon()
        if fault:
            logger.warning("fault injection: %s: dropped the group its leader began with this worker", fault)
            matchmaking._dilocox_dropped = fault == "abandon_accepted"
            return None
        return await assemble(leader, message)

    matchmaking.follower_assemble_group = assemble_unless_abandoned


def screen_join_requests(matchmaking: Any, extra: Callable[[str], bool]) -> None:
    """Wrap `matchmaking._check_reasons_to_reject` (once), the leader's answer to a request to join its group:
    - a refusal is said at info with hivemind's code (NOT_LOOKING_FOR_GROUP, BAD_EXPIRATION_TIME, ...), which
      hivemind tells the follower at debug level only: a round that split because its members refused each other at
      once is read from these lines (the follower's side says "no group after 0.00 s": track_join_requests);
    - a follower that the leader accepts and that `extra` says the round's target did not count (extra records it,
      and says so once per round) raises the target by one (module docstring)."""
    if getattr(matchmaking, "_dilocox_screens_joins", False):
        return
    matchmaking._dilocox_screens_joins = True
    check = matchmaking._check_reasons_to_reject

    def check_screened(request: Any, context: Any) -> Any:
        refusal = check(request, context)
        if refusal is not None:
            codes = averaging_pb2.MessageCode
            why = codes.Name(refusal.code) if refusal.code in codes.values() else refusal.code
            logger.info("refused %s's request to join this worker's group: %s", context.remote_id, why)
        elif matchmaking.target_group_size is not None and extra(context.remote_id.to_base58()):
            set_target_size(matchmaking, matchmaking.target_group_size + 1)
        return refusal

    matchmaking._check_reasons_to_reject = check_screened


def looking_for_group(matchmaking: Any) -> bool:
    """Whether this worker's search for the current round's group runs and has declared itself under its key."""
    mm = matchmaking
    return mm.is_looking_for_group and mm.potential_leaders.declared_group_key == mm.group_key_manager.current_key


def asked_leaders(matchmaking: Any) -> list[str]:
    """The leaders this worker's latest searches asked to take it, oldest first (`track_join_requests`)."""
    return list(getattr(matchmaking, "_dilocox_asked", ()))


def asking(matchmaking: Any) -> set[str]:
    """The leaders a request of this worker is in flight to (`track_join_requests`)."""
    return set(getattr(matchmaking, "_dilocox_asking", ()))


def refuses_mutual_ask(matchmaking: Any, peer: str, expiration: float) -> bool:
    """Whether a request from `peer` (declared until `expiration`) to lead it is one of a mutual ask that this
    worker refuses at once (module docstring): this worker is asking `peer` to lead it, and `peer` is the one
    hivemind's order makes the leader (the earlier expiration; the smaller peer id if equal). The other side
    does not refuse: its handler waits for the join lock, which its own request frees as soon as this refusal
    reaches it, and takes this worker in."""
    if peer not in asking(matchmaking):
        return False
    mine = matchmaking.potential_leaders.declared_expiration_time
    me = matchmaking.peer_id.to_base58()
    return mine is None or (expiration, peer) < (mine, me)


def joining(matchmaking: Any) -> bool:
    """Whether a request of this worker to a leader is in flight (`track_join_requests`)."""
    return bool(asking(matchmaking))


def outside_every_group(matchmaking: Any, group_id: bytes) -> bool:
    """Whether this worker is neither in the group `group_id` (its search never returned it) nor about to learn
    of a group: it follows no leader, waits for no leader's answer, and its own search assembled none. Its
    averager then answers a part of that group at once: it was counted in by a leader it had given up on
    (module docstring)."""
    return (
        group_id not in getattr(matchmaking, "_dilocox_assembled", ())
        and matchmaking.current_leader is None
        and not joining(matchmaking)
        and not matchmaking.assembled_group.done()
    )


def set_target_size(matchmaking: Any, target: int) -> None:
    """Set the search's target group size where hivemind reads it (matchmaking, leader queue, key manager)."""
    matchmaking.target_group_size = matchmaking.potential_leaders.target_group_size = target
    matchmaking.group_key_manager.target_group_size = target


async def lower_target(matchmaking: Any, target: int) -> bool:
    """Lower the search's target group size to `target` (never raise it); a leader that is not following
    anyone and already holds `target` members (itself included) assembles its group now. Returns whether
    this call assembled a group."""
    mm = matchmaking
    if mm.target_group_size is not None and target >= mm.target_group_size:
        return False
    set_target_size(mm, target)
    async with mm.lock_request_join_group:
        ready = len(mm.current_followers) + 1 >= max(target, mm.min_group_size)
        if not (mm.is_looking_for_group and mm.current_leader is None and not mm.assembled_group.done() and ready):
            return False
        logger.debug("a member left the round: the group of %d starts now", len(mm.current_followers) + 1)
        await mm.leader_assemble_group()
        return True
