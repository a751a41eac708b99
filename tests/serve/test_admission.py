"""hf_alibi.serve.guard.Admission alone, on an event loop: at most ``limit`` inside, the others served in arrival
order, at most ``queued`` waiting (one more: 429), a waiting client that leaves gives up its turn without taking a
place, and a cancelled waiter leaves nothing behind. The reference is the order written out in each test."""

from __future__ import annotations

import asyncio

import pytest

from hf_alibi.serve.guard import Admission
from hf_alibi.serve.request_checks import BadRequest


class Client:
    """An ASGI ``receive`` whose client leaves when :meth:`leave` is called."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self):
        self.gone.set()


def test_places_are_given_in_arrival_order_and_the_queue_is_bounded():
    async def scenario():
        gate, entered = Admission(limit=2, queued=3), []

        async def request(name: str, client: Client):
            if await gate.enter(client.receive):
                entered.append(name)
                return True
            return False

        clients = {name: Client() for name in "abcdef"}
        tasks = {}
        for name in "abcde":
            tasks[name] = asyncio.ensure_future(request(name, clients[name]))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert entered == ["a", "b"] and (gate.inside, gate.waiting) == (2, 3)
        with pytest.raises(BadRequest) as busy:  # the sixth: the queue is full
            await gate.enter(clients["f"].receive)
        assert busy.value.status == 429 and busy.value.code == "server_busy"
        assert "2 requests are being answered and 3 wait" in str(busy.value)
        clients["c"].leave()  # waiting, its client leaves: no place taken, out of the queue
        assert await tasks["c"] is False
        assert (gate.inside, gate.waiting) == (2, 2)
        gate.leave()  # a's place: to d, the first still waiting
        await asyncio.sleep(0.01)
        assert entered == ["a", "b", "d"] and (gate.inside, gate.waiting) == (2, 1)
        tasks["e"].cancel()  # the server stopping: e's turn given up
        await asyncio.sleep(0.01)
        assert (gate.inside, gate.waiting) == (2, 0)
        for _ in range(2):
            gate.leave()
        assert (gate.inside, gate.waiting) == (0, 0)
        assert await gate.enter(Client().receive) is True and gate.inside == 1  # free again: in at once

    asyncio.run(scenario())


def test_a_place_that_comes_as_its_client_leaves_goes_to_the_next():
    async def scenario():
        gate = Admission(limit=1, queued=4)
        assert await gate.enter(Client().receive)
        first, second = Client(), Client()
        one = asyncio.ensure_future(gate.enter(first.receive))
        two = asyncio.ensure_future(gate.enter(second.receive))
        await asyncio.sleep(0.01)
        first.leave()  # both in the same step: its client gone, and its turn given
        gate.leave()
        assert await one is False
        assert await two is True and (gate.inside, gate.waiting) == (1, 0)

    asyncio.run(scenario())
