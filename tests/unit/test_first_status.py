"""`up` meets each node with its first status (coordinator/serve/up.py `first_status`): a port
that refuses the call right after the node said it serves is asked again; any other failure, or
the last refusal, is the answer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from moe_cluster.coordinator.serve.up import first_status


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "failed to connect"


class _Client:
    def __init__(self, *failures: grpc.StatusCode):
        self.failures, self.calls = list(failures), 0

    async def status(self):
        self.calls += 1
        if self.failures:
            raise _Refused(self.failures.pop(0))
        return "status"


def test_a_refused_first_call_is_asked_again_and_the_rest_is_the_answer():
    refused = grpc.StatusCode.UNAVAILABLE
    client = _Client(refused, refused)
    assert asyncio.run(first_status(client, pause_s=0.01)) == "status" and client.calls == 3
    client = _Client(refused, refused, refused)
    with pytest.raises(_Refused) as err:
        asyncio.run(first_status(client, pause_s=0.01))
    assert err.value.code() == refused and client.calls == 3
    client = _Client(grpc.StatusCode.UNAUTHENTICATED)  # a wrong secret is not asked again
    with pytest.raises(_Refused):
        asyncio.run(first_status(client, pause_s=0.01))
    assert client.calls == 1
