"""A policy served by `hf_vla.serve` (or any openpi policy server) as evaluation drives it: openpi-client's
websocket client with the episode seed, observe-only steps and real-time chunking fields of the protocol."""

from __future__ import annotations

import os

import numpy as np

from hf_vla.errors import ConnectionFailedError


class RemotePolicy:
    """A policy served by `hf_vla.serve` (or any openpi policy server), through openpi-client's websocket client.

    `api_key` (default: the `HF_VLA_API_KEY` environment variable) is sent at the handshake, as the server expects.
    Sends the env's observation dict with the task under `prompt` and, for real-time chunking, `rtc/inference_delay`
    and `rtc/executed_steps`; returns the `actions` of the reply, and keeps its `rtc/method` (how the server continued
    the previous chunk; absent when it did not) like `PolicyRunner.last_rtc_method`.
    """

    def __init__(self, uri: str, api_key: str | None = None):

        from openpi_client.websocket_client_policy import WebsocketClientPolicy
        from websockets.exceptions import InvalidStatus, InvalidURI

        try:
            self.client = WebsocketClientPolicy(uri, api_key=api_key or os.environ.get("HF_VLA_API_KEY"))
        except InvalidStatus as error:
            status = error.response.status_code
            hint = ": set HF_VLA_API_KEY to the server's key" if status == 401 else ""
            raise ConnectionFailedError(f"policy server {uri} refused the connection (HTTP {status}){hint}") from error
        except (OSError, InvalidURI, TimeoutError) as error:
            raise ConnectionFailedError(f"cannot connect to the policy server {uri}: {error}") from error
        self.metadata = self.client.get_server_metadata()
        self.last_rtc_method: str | None = None
        self.uri, self.api_key = uri, api_key
        self._episode_seed: int | None = None
        # a MEM policy (its contract's `memory`): the server keeps this connection's past, so every step goes to it
        self.memory = ((self.metadata or {}).get("deployment") or {}).get("memory")

    def fork(self) -> RemotePolicy:
        """Another connection to the same server (one per env slot: each keeps its own noise and last chunk)."""
        return RemotePolicy(self.uri, self.api_key)

    def reset(self, seed: int | None = None) -> None:
        """A new episode: the next request carries `episode_seed`, which re-seeds this connection's noise."""
        self._episode_seed = seed

    def observe(self, observation: dict) -> None:
        """A step without a chunk, for a MEM policy's past (`observe_only`; the episode loop calls it)."""
        request = {**observation, "observe_only": True}
        if self._episode_seed is not None:
            request["episode_seed"], self._episode_seed = int(self._episode_seed), None
        self.client.infer(request)

    def __call__(self, observation: dict, task: str, inference_delay: int = 0, executed_steps: int | None = None):
        request = {**observation, "prompt": task, "rtc/inference_delay": int(inference_delay)}
        if executed_steps is not None:
            request["rtc/executed_steps"] = int(executed_steps)
        if self._episode_seed is not None:
            request["episode_seed"], self._episode_seed = int(self._episode_seed), None
        reply = self.client.infer(request)
        self.last_rtc_method = reply.get("rtc/method")
        return np.asarray(reply["actions"])
