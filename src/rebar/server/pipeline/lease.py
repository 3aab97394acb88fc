"""The lease stage: the request runs on the chat model's current version, held until its answer has
been produced (a whole answer) or its stream has ended, so a reload can switch new requests to a
new version while this one finishes on the old."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi.responses import Response

from rebar.server.pipeline.call import Call, Next, Outcome
from rebar.server.pipeline.results import StreamItem
from rebar.serving.instances import ChatModel, Lease

if TYPE_CHECKING:
    from rebar.server.state import ServerState

VERSION_HEADER = "X-Rebar-Model-Version"  # which version of the model produced a response


async def run(call: Call, next: Next) -> Outcome:
    registry = call.state.registry
    registry.check_ready()
    lease = await registry.acquire_chat(call.request.model)
    try:
        call.model = lease.version
        outcome = await next(call)
    except BaseException:
        lease.release()
        raise
    outcome.headers[VERSION_HEADER] = lease.version.label
    if outcome.items is None:
        lease.release()
    else:
        outcome.items = held(lease, outcome.items)
    return outcome


def held(lease: Lease, items: AsyncGenerator[StreamItem, None]) -> AsyncGenerator[StreamItem, None]:
    """`items`, releasing `lease` when they end, or when the stream is dropped unread (a client
    that left before its body started)."""

    async def release_after() -> AsyncGenerator[StreamItem, None]:
        try:
            async for item in items:
                yield item
        finally:
            try:
                await items.aclose()
            finally:
                lease.release()

    stream = release_after()
    weakref.finalize(stream, _call_soon, asyncio.get_running_loop(), lease.release)
    return stream


async def with_chat_model(
    state: ServerState, name: str | None, answer: Callable[[ChatModel], Awaitable[Response]]
) -> Response:
    """`answer(model)` on a lease of the chat model `name` (None: the default one), for routes
    that use a model without generating (tokenize, profiles); released once it has answered."""
    state.registry.check_ready()
    lease = await state.registry.acquire_chat(name)
    try:
        response = await answer(lease.version)
    finally:
        lease.release()
    response.headers[VERSION_HEADER] = lease.version.label
    return response


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(callback)
