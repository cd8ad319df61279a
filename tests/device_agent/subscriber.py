"""An app reading a model's pipeline results in a thread, as Subscribe or SubscribeBatches."""

from __future__ import annotations

import threading

import grpc

from protos import agent_pb2


class Subscriber:
    """Reads `model`'s results from an AgentService stub; `batched`: SubscribeBatches.

    `messages` holds (results in it, its size) for each message received.
    """

    def __init__(self, agent_stub, model: str, *, batched: bool = False) -> None:
        self.messages: list[tuple[int, int]] = []
        self.results: list[agent_pb2.PipelineResult] = []
        self.error: grpc.RpcError | None = None
        self.ended = False
        self._changed = threading.Condition()
        subscribe = agent_stub.SubscribeBatches if batched else agent_stub.Subscribe
        self.call = subscribe(agent_pb2.SubscribeRequest(model=model))
        self._batched = batched
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                results = list(message.results) if self._batched else [message]
                with self._changed:
                    self.messages.append((len(results), message.ByteSize()))
                    self.results += results
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            with self._changed:
                self.ended = True
                self._changed.notify_all()

    def subscribed(self) -> None:
        """Wait until the agent holds the subscription (it answers with headers then)."""
        self.call.initial_metadata()
        assert not self.ended, self.error

    def wait_for(self, n: int, timeout: float = 30) -> list[agent_pb2.PipelineResult]:
        with self._changed:
            self._changed.wait_for(lambda: len(self.results) >= n or self.ended, timeout)
            assert len(self.results) >= n, (len(self.results), n, self.error)
            return self.results[:n]

    def wait_accounted(self, total: int, timeout: float = 60) -> list:
        """Wait until the results received and those said to be dropped make `total`."""

        def accounted() -> int:
            return len(self.results) + sum(r.dropped_before for r in self.results)

        with self._changed:
            self._changed.wait_for(lambda: accounted() >= total or self.ended, timeout)
            assert accounted() == total, (len(self.results), accounted(), total, self.error)
            return list(self.results)

    def wait_ended(self, timeout: float = 30) -> grpc.RpcError | None:
        self._thread.join(timeout)
        assert self.ended
        return self.error

    def stopped(self, timeout: float = 10) -> bool:
        """Whether the reading thread ended within `timeout`."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self) -> None:
        self.call.cancel()
        self._thread.join(10)
