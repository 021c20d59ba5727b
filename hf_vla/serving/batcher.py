"""The one thread that runs the model for every connection of a server, batching requests that can share a forward."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from hf_vla.serving.policy import PreparedRequest, sample_batch


class Batcher:
    """One thread runs the model. Requests that arrive while it is busy wait in a queue; the next forward takes all of
    them that can share one (`PreparedRequest.batch_key`: same input shapes, no RTC), up to `max_batch` rows. So a
    lone client is served at once, and N clients cost about one forward instead of N (`benchmarks/speed/serve_load.py`)."""

    def __init__(self, model, device, max_batch: int = 8):
        self.model, self.device, self.max_batch = model, device, max(1, int(max_batch))
        self.queue: queue.Queue = queue.Queue()
        self.batch_sizes: list[int] = []  # of the last forwards, for the log and the tests
        threading.Thread(target=self._loop, name="hf_vla-batcher", daemon=True).start()

    def submit(self, request: PreparedRequest) -> torch.Tensor:
        """The request's chunk `[chunk, max_action_dim]` (normalised), once its forward has run."""
        future: Future = Future()
        self.queue.put((request, future))
        return future.result()

    def _loop(self) -> None:
        while True:
            pending = [self.queue.get()]
            while True:
                try:
                    pending.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            groups: dict = {}
            for request, future in pending:  # arrival order within a group
                key = request.batch_key()
                groups.setdefault(key if key is not None else id(future), []).append((request, future))
            for group in groups.values():
                for begin in range(0, len(group), self.max_batch):
                    self._run(group[begin : begin + self.max_batch])

    def _run(self, part: list) -> None:
        try:
            chunks = sample_batch(self.model, [request for request, _ in part], self.device)
        except BaseException as error:  # every waiting request learns it; the loop goes on
            for _, future in part:
                future.set_exception(error)
            return
        self.batch_sizes = (self.batch_sizes + [len(part)])[-1000:]
        for (_, future), chunk in zip(part, chunks):
            future.set_result(chunk.clone())


__all__ = ["Batcher"]
