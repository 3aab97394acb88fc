"""`POST /v1/documents/summarize`: a document uploaded (multipart `file`) or named by a path under
`documents.folder` (a form field or JSON `path`), summarised on a chat model in a style.

The answer streams as server-sent events (`planned`, `progress` per finished request, `section`,
`statement` with its pages, then `summary`); `stream=false` answers the whole summary as JSON. A
client that disconnects cancels every request of its summary. Files rebar cannot read are typed
4xx answers before anything streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from rebar.documents.events import (
    Event,
    Planned,
    Progress,
    SectionStart,
    StatementWritten,
    Summary,
    render_statement,
)
from rebar.documents.extract import read_document, read_path, resolve_under
from rebar.documents.generator import EngineGenerator
from rebar.documents.options import document_limits, summary_options
from rebar.documents.prompts import STYLES, Style
from rebar.documents.summarize import summarize
from rebar.errors import InvalidRequestError, RebarError
from rebar.server import sse
from rebar.server.errors import problem_of
from rebar.server.pipeline.lease import VERSION_HEADER
from rebar.server.state import server_state
from rebar.serving.instances import Lease

router = APIRouter()
PATH = "/v1/documents/summarize"
FIELDS = ("file", "path", "style", "model", "stream")
# What a multipart form adds around the file: boundaries, part headers, the other fields.
FORM_FRAMING_BYTES = 64 * 1024


@router.post(PATH)
async def summarize_document(request: Request) -> Response:
    state = server_state(request)
    settings = state.registry.settings.documents
    form = await _fields(request)
    style = _style(form.get("style", "abstract"))
    stream = _flag(form.get("stream", True))
    document = await _document(form, settings)
    state.registry.check_ready()
    lease = await state.registry.acquire_chat(_text(form.get("model"), "model"))
    try:
        model = lease.version
        generator = EngineGenerator(model.front, model.text, model.label)
        events = summarize(document, generator, summary_options(settings, style), state.summaries)
        first = await anext(events)  # a context too small for summaries is a 400 here
    except BaseException:
        lease.release()
        raise
    headers = {VERSION_HEADER: model.label}
    if not stream:
        try:
            summary = await _last(first, events)
        finally:
            lease.release()
        return JSONResponse(_summary_body(summary), headers=headers)
    return sse.response(_stream(first, events, lease, style, state.ping_interval_s), headers)


async def _fields(request: Request) -> dict[str, Any]:
    """The request's fields: a multipart/urlencoded form, or a JSON object."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the JSON body must be an object")
        fields = body
    elif kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form(max_files=1, max_fields=len(FIELDS))
        fields = dict(form.items())
    else:
        raise InvalidRequestError(
            "send the document as multipart/form-data (field `file`) or JSON with `path`"
        )
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise InvalidRequestError(f"parameter {unknown[0]!r} is not supported", unknown[0])
    return fields


async def _document(form: dict[str, Any], settings: Any):
    upload, path = form.get("file"), form.get("path")
    if (upload is None) == (path is None):
        raise InvalidRequestError("give exactly one of file (an upload) or path", "file")
    limits = document_limits(settings)
    if isinstance(upload, UploadFile):
        data = await upload.read()
        name = upload.filename or "document"
        return await asyncio.to_thread(read_document, name, data, limits)
    if upload is not None:
        raise InvalidRequestError("file must be an uploaded file (multipart/form-data)", "file")
    target = resolve_under(settings.folder, _text(path, "path") or "")
    return await asyncio.to_thread(read_path, target, limits)


def _style(value: Any) -> Style:
    if value not in get_args(Style):
        raise InvalidRequestError(f"style must be one of {', '.join(STYLES)}", "style")
    return value


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise InvalidRequestError("stream must be true or false", "stream")


def _text(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param)
    return value or None


async def _last(first: Event, events: AsyncIterator[Event]) -> Summary:
    last = first
    async for event in events:
        last = event
    assert isinstance(last, Summary), "a summary ends with its Summary"
    return last


async def _stream(
    first: Event, events: AsyncIterator[Event], lease: Lease, style: Style, ping_s: float
) -> AsyncIterator[str]:
    """The events as SSE, with a ping whenever nothing happened for `ping_s` (a send is how a
    client that left is noticed); an error after the stream started is an `error` event. Closing
    this (a client gone) closes the summary, which cancels its requests."""
    pending = _Pending(events)
    try:
        yield _sse(first, style)
        while True:
            try:
                item = await asyncio.wait_for(pending.get(), ping_s)
            except TimeoutError:
                yield sse.PING
                continue
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield _sse(item, style)
    except RebarError as exc:
        problem = problem_of(exc)
        yield sse.event({"error": {"message": problem.message, "code": problem.code}}, "error")
    finally:
        try:
            await pending.close()
        finally:
            lease.release()


class _Pending:
    """`events` read by a task of their own into a queue (None at their end, or the error they
    raised): waiting on the queue can time out without touching the summary."""

    def __init__(self, events: AsyncIterator[Event]) -> None:
        self._queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._read(events))

    async def _read(self, events: AsyncIterator[Event]) -> None:
        try:
            async for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(None)
        except Exception as exc:
            self._queue.put_nowait(exc)

    async def get(self) -> Event | BaseException | None:
        return await self._queue.get()

    async def close(self) -> None:
        """Stops reading: the summary's generator is closed, which cancels its requests."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _sse(event: Event, style: Style) -> str:
    if isinstance(event, Planned):
        return sse.event(asdict(event), "planned")
    if isinstance(event, Progress):
        return sse.event(asdict(event), "progress")
    if isinstance(event, SectionStart):
        return sse.event(asdict(event), "section")
    if isinstance(event, StatementWritten):
        statement = event.statement
        body = {**asdict(statement), "rendered": render_statement(statement, style)}
        return sse.event(body, "statement")
    return sse.event(_summary_body(event), "summary")


def _summary_body(summary: Summary) -> dict[str, Any]:
    return {**summary.to_json(), "text": summary.render()}
