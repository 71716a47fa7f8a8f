"""The call bridge: the servicer's bodies run on worker threads, callers wait on the event loop.

grpc's sync server hands a call to a worker thread before its request message has arrived, so a
handful of callers that send headers and nothing more hold every worker (health checks included).
Here each KVStore method is an async handler on a ``grpc.aio`` server that receives its request
messages, and sends its response messages, on the event loop; only the servicer's bodies
(validation, Store work, copies) run on the worker pool, a step at a time. Every method is
registered request-streaming, so the bridge, not gRPC, reads even a unary request: gRPC would wait
for it without a bound.

Waiting is bounded by the stall watch (``stalls.py``): a call is watched while it waits for its
request message, a stream for its whole life, and one idle for too long is cut with CANCELLED.
Errors: a ``KVStoreError`` becomes its gRPC status with trailing metadata naming the class and the
field, so the client raises the same class; anything unexpected is logged and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import grpc

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.service.metrics import Metrics
from kvstore.service.stalls import Progress, StallWatch
from kvstore.service.validation import well_formed

log = logging.getLogger("kvstore.service.calls")

_EOF = grpc.aio.EOF
STEP_BYTES = 1 << 20   # stream messages handed to or taken from a worker at once


def status_of(err: Exception, call: str = "") -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status, details and trailing metadata a call that raised ``err`` is answered with. An
    error that is no ``KVStoreError`` is unexpected: it is logged with the ``call`` it ended."""
    if isinstance(err, KVStoreError):
        meta = [("kvstore-error", type(err).__name__)]
        if getattr(err, "field", None):
            meta.append(("kvstore-field", str(err.field)))
        return getattr(grpc.StatusCode, err.grpc_status, grpc.StatusCode.INTERNAL), str(err)[:2000], tuple(meta)
    log.error("unexpected error in %s", call, exc_info=err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"[:2000], ()


class CallContext:
    """What a handler body sees of its call from a worker thread: the part of grpc's sync
    ``ServicerContext`` the servicer uses. ``cancel`` may come from any thread (the stall watch)."""

    def __init__(self, context, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        self._context = context
        self._loop = loop
        self._task = task
        self._ended = threading.Event()
        self.cut = False   # ended by the daemon (a stalled caller), not by the caller
        self.tenant: str | None = None   # the caller's tenant once ServiceState.tenant_of resolved it

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(tuple(metadata))

    def is_active(self) -> bool:
        return not self._ended.is_set()

    def cancel(self) -> None:
        """End the call: its handler stops at the next wait and the caller gets CANCELLED."""
        if not self._ended.is_set():
            self.cut = True
            self._ended.set()
            self._loop.call_soon_threadsafe(self._task.cancel)

    def end(self) -> None:
        self._ended.set()


class _Steps:
    """One call's steps on the worker pool, one at a time. A step cannot be interrupted, so when
    the call is cut mid-step the next step (e.g. the close that unpins) waits for it to finish.
    A step is the daemon's work (``progress.working``): the stall watch does not count it against
    the caller."""

    def __init__(self, pool: Executor, progress: Progress) -> None:
        self.pool = pool
        self.progress = progress
        self._running: asyncio.Future | None = None

    def _work(self, fn: Callable, *args):
        with self.progress.working():
            return fn(*args)

    @property
    def busy(self) -> bool:
        return self._running is not None and not self._running.done()

    async def start(self, fn: Callable, *args) -> None:
        """Begin ``fn(*args)`` once the step before it is done (its error, if any, is raised now)."""
        await self.settle()
        self._running = asyncio.get_running_loop().run_in_executor(self.pool, self._work, fn, *args)
        # a step whose call ended before anyone asked for its outcome must not be logged as lost
        self._running.add_done_callback(lambda step: step.cancelled() or step.exception())

    async def _finished(self) -> asyncio.Future | None:
        """The running step once it is done (a cancelled call waits too); none runs after."""
        running = self._running
        if running is not None and not running.done():
            await asyncio.wait([running])
        self._running = None
        return running

    async def settle(self):
        """Wait for the running step; its result, or its error."""
        running = await self._finished()
        return None if running is None else running.result()

    async def run(self, fn: Callable, *args):
        await self.start(fn, *args)
        return await self.settle()

    async def cleanup(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` after the running step, whatever became of that one (the call
        reports its error, or has already ended)."""
        await self._finished()
        await self.run(fn, *args)


def _take(responses, budget: int) -> list:
    """Responses from the generator up to ``budget`` bytes (at least one; none when it is done),
    so a stream of small messages costs one worker hand-off per batch, not per message."""
    batch, size = [], 0
    for response in responses:
        batch.append(response)
        size += len(response) if isinstance(response, bytes) else response.ByteSize()
        if size >= budget:
            break
    return batch


async def _request(context):
    """A unary request's message (``validation.well_formed``)."""
    request = await context.read()
    if request is _EOF:
        raise InvalidArgument("request", "the call ended before its request message")
    return well_formed(request)


def _feed(sink, messages: list) -> None:
    for message in messages:
        sink.feed(message)


class CallBridge:
    def __init__(self, pool: Executor, stalls: StallWatch, metrics: Metrics) -> None:
        self.pool = pool
        self.stalls = stalls
        self.metrics = metrics

    def method_handler(self, method, body: Callable, parse: Callable, serialize: Callable) -> grpc.RpcMethodHandler:
        """The aio handler serving ``body`` (a servicer method) for ``method`` (its descriptor):
        unary bodies take ``(request, context)``; server-streaming ones return a generator of
        responses; a client-streaming one takes ``(first_message, context)`` and returns a sink
        with ``feed(message)``, ``finish() -> response`` and ``close()``."""
        name = method.name
        serve = (self._client_stream if method.client_streaming else
                 self._server_stream if method.server_streaming else self._unary)

        async def handle(requests, context):
            return await self._serve(name, context, lambda call: serve(body, context, call))

        def encoded(response) -> bytes:   # responses a body encoded itself (``chunks``) go out as they are
            return response if isinstance(response, bytes) else serialize(response)
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming \
            else grpc.stream_unary_rpc_method_handler
        return make(handle, request_deserializer=parse, response_serializer=encoded)

    async def _serve(self, name: str, context, work: Callable):
        """Run ``work(call)``; answer its failure with the status it stands for."""
        call = CallContext(context, asyncio.get_running_loop(), asyncio.current_task())
        started = time.perf_counter()
        code = None
        try:
            return await work(call)
        except grpc.aio.BaseError:
            raise   # gRPC's own: an abort under way, the server stopping, the caller gone
        except asyncio.CancelledError:
            if not call.cut:
                raise   # the caller went away
            asyncio.current_task().uncancel()
            code, meta = grpc.StatusCode.CANCELLED, ()
            details = f"{name}: no progress for {self.stalls.idle_s:g}s (stalled caller); the call was cut"
        except Exception as err:  # noqa: BLE001 - every failure becomes a status, never a crash
            code, details, meta = status_of(err, name)
        finally:
            call.end()
            self.metrics.observe(name, time.perf_counter() - started, code.name if code else None)
        context.set_trailing_metadata(meta)
        try:
            await context.abort(code, details)   # a cut Get's status waits behind the responses not yet taken
        except grpc.aio.InternalError:
            raise asyncio.CancelledError from None   # the caller left before its status went out: nothing to say

    async def _unary(self, body: Callable, context, call: CallContext):
        with self.stalls.watch(call.cancel):
            request = await _request(context)
        return await asyncio.get_running_loop().run_in_executor(self.pool, body, request, call)

    async def _server_stream(self, body: Callable, context, call: CallContext) -> None:
        with self.stalls.watch(call.cancel) as progress:
            steps = _Steps(self.pool, progress)
            responses = body(await _request(context), call)   # a generator: nothing has run yet
            try:
                await steps.start(_take, responses, STEP_BYTES)
                while batch := await steps.settle():
                    await steps.start(_take, responses, STEP_BYTES)   # the next batch is read meanwhile
                    for response in batch:
                        await context.write(response)
                        progress.touch()
            finally:
                await steps.cleanup(responses.close)   # unpins whatever it still holds

    async def _client_stream(self, open_sink: Callable, context, call: CallContext):
        """Messages are received while the previous ones are being stored (at most ``STEP_BYTES``
        of them wait), and fed to the sink a batch per step."""
        with self.stalls.watch(call.cancel) as progress:
            steps = _Steps(self.pool, progress)
            first = await context.read()
            progress.touch()
            sink = await steps.run(open_sink, None if first is _EOF else well_formed(first), call)
            try:
                batch, size = [], 0
                while (message := await context.read()) is not _EOF:
                    progress.touch()
                    batch.append(well_formed(message))
                    size += message.ByteSize()
                    if not steps.busy or size >= STEP_BYTES:
                        await steps.start(_feed, sink, batch)
                        batch, size = [], 0
                await steps.run(_feed, sink, batch)
                return await steps.run(sink.finish)
            finally:
                await steps.cleanup(sink.close)
