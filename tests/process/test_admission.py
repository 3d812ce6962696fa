"""serve's admission queue (meshnet/serve/admission.py) on its own: slots, a first-come
queue and its bounds, on one asyncio loop, with slots given back as sessions' threads do."""

import asyncio
import threading

import pytest

from meshnet.core import errors
from meshnet.core.errors import MeshnetError
from meshnet.serve.admission import Admission, ClientGone


async def never_gone():
    return False


async def settle():
    """Let callbacks handed to the loop run."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_slots_are_taken_at_once_then_requests_wait_and_are_served_first_come():
    async def main():
        admission = Admission(max_queue=4, max_wait=60)
        await admission.take(2, never_gone)
        await admission.take(2, never_gone)
        order = []

        async def wait(name):
            await admission.take(2, never_gone)
            order.append(name)
        tasks = [asyncio.ensure_future(wait(name)) for name in ("a", "b", "c")]
        await settle()
        assert (admission.active, admission.queued, order) == (2, 3, [])
        threading.Thread(target=admission.give).start()   # (a session's thread)
        await asyncio.wait_for(tasks[0], 5)
        await settle()
        assert (order, admission.active, admission.queued) == (["a"], 2, 2)
        admission.give()
        admission.give()
        await asyncio.wait_for(asyncio.gather(*tasks[1:]), 5)
        assert order == ["a", "b", "c"] and admission.active == 2 and admission.queued == 0
        assert "meshnet_http_queue_wait_seconds_count{} 5" in admission.prometheus()
    asyncio.run(main())


def test_a_full_queue_refuses_at_once_and_a_wait_that_runs_out_is_refused():
    async def main():
        admission = Admission(max_queue=1, max_wait=3.0)   # (past any stall of a loaded machine between the steps)
        await admission.take(1, never_gone)
        waiting = asyncio.ensure_future(admission.take(1, never_gone))
        await settle()
        with pytest.raises(MeshnetError) as full:
            await admission.take(1, never_gone)
        assert full.value.code == errors.TOO_MANY_SESSIONS and "--max-queue" in full.value.message
        with pytest.raises(MeshnetError) as over:
            await waiting
        assert over.value.code == errors.TOO_MANY_SESSIONS and "--queue-wait" in over.value.message
        assert admission.queued == 0 and admission.active == 1
        assert admission.refused == {"queue_full": 1, "wait_over": 1}
    asyncio.run(main())


def test_a_waiter_that_leaves_loses_its_place_and_a_slot_handed_to_it_goes_on():
    async def main():
        admission = Admission(max_queue=4, max_wait=60)
        await admission.take(1, never_gone)
        gone = asyncio.Event()

        async def is_gone():
            return gone.is_set()
        leaving = asyncio.ensure_future(admission.take(1, is_gone))
        staying = asyncio.ensure_future(admission.take(1, never_gone))
        await settle()
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(leaving, 5)
        assert admission.queued == 1
        # a slot handed over just as its waiter is cancelled passes to the next one
        cancelled = asyncio.ensure_future(admission.take(1, never_gone))
        await settle()
        admission.give()   # -> staying
        await asyncio.wait_for(staying, 5)
        admission.give()   # -> cancelled, whose wake-up is still queued on the loop
        cancelled.cancel()
        await settle()
        assert admission.active == 0 and admission.queued == 0
        await asyncio.wait_for(admission.take(1, never_gone), 5)   # the slot was not lost
    asyncio.run(main())


def test_a_route_with_more_slots_frees_waiters_and_stopping_refuses_them():
    async def main():
        admission = Admission(max_queue=4, max_wait=60)
        await admission.take(1, never_gone)
        first = asyncio.ensure_future(admission.take(1, never_gone))
        second = asyncio.ensure_future(admission.take(1, never_gone))
        await settle()
        # a newcomer seeing a route of 2 slots hands the free one to the longest waiter
        third = asyncio.ensure_future(admission.take(2, never_gone))
        await asyncio.wait_for(first, 5)
        assert not second.done() and admission.queued == 2
        admission.stop_all()
        for task in (second, third):
            with pytest.raises(MeshnetError) as stopped:
                await asyncio.wait_for(task, 5)
            assert stopped.value.code == errors.SHUTTING_DOWN
        with pytest.raises(MeshnetError):
            await admission.take(2, never_gone)
    asyncio.run(main())
