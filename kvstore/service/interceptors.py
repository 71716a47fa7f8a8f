"""Authentication at the door: a KVStore call without a known bearer token is refused from its headers.

The interceptor runs on the event loop when a call's headers arrive, before any request message
is read and before a worker thread is involved, so an unauthenticated caller is answered
UNAUTHENTICATED at once: it never gets to stream bytes at the daemon and costs nothing while it
dawdles. Handlers still ask ``Authenticator.tenant`` which tenant is calling (defence in depth:
nothing reaches the Store unauthenticated even if the interceptor were left out). Health and
reflection stay open: probes carry no token. The refusal never repeats the offered token.
"""

from __future__ import annotations

import grpc

from kvstore.errors import Unauthenticated
from kvstore.service.auth import Authenticator
from kvstore.service.calls import status_of


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, service_name: str, method_names, metrics=None) -> None:
        self.auth = auth
        # full method path -> name; an unknown method falls through to gRPC's UNIMPLEMENTED (and
        # never becomes a metrics label: callers must not be able to mint label values)
        self.methods = {f"/{service_name}/{name}": name for name in method_names}
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        name = self.methods.get(handler_call_details.method)
        if name is not None and self.auth.enabled:
            try:
                self.auth.tenant(handler_call_details.invocation_metadata)
            except Unauthenticated as err:
                return self._refusal(name, err)
        return await continuation(handler_call_details)

    def _refusal(self, name: str, err: Unauthenticated) -> grpc.RpcMethodHandler:
        code, details, meta = status_of(err)
        if self.metrics is not None:
            self.metrics.observe(name, 0.0, code.name)

        async def refuse(requests, context):
            # request-streaming, so gRPC does not wait for (or read) a request message first
            context.set_trailing_metadata(meta)
            await context.abort(code, details)

        return grpc.stream_unary_rpc_method_handler(refuse)
