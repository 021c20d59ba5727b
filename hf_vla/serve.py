"""Serve a checkpoint to robots over openpi's websocket policy protocol.

    python -m hf_vla.serve --checkpoint outputs/demo --port 8000
    python -m hf_vla.serve --checkpoint my/pi05-droid --head droid::joint_velocity \\
        --cameras observation/exterior_image_1_left observation/wrist_image_left \\
        --state observation/joint_position observation/gripper_position

The protocol is openpi's (`openpi_client.websocket_client_policy.WebsocketClientPolicy` connects unmodified): on
connect the server sends its metadata; then each binary message is a msgpack-numpy observation dict (camera images
HxWx3 uint8, state arrays, `prompt`) and the reply is `{"actions": [chunk, action_dim], "server_timing": {...}}`,
actions un-normalised for the head. A request the policy cannot use gets a text reply naming the key and the problem
(the client raises it), no actions, and the connection stays open: a missing camera, a wrong state size or an unknown
head, and input that is garbage (NaN/inf in the state or in float images, float pixels outside [0, 1], images larger
than `--max_image_side`, a state or RTC leftover far outside the training range, a prompt that is not a string, an
array whose dtype is not plain bool/int/float or whose shape does not fit its bytes). A message larger than
`--max_message_mb` is refused unread (the connection closes with code 1009); a client beyond `--max_connections` is
refused at the handshake (HTTP 503). An internal error replies with a request id, never a traceback; the traceback is
in the server log under that id. `GET /healthz` answers OK. Concurrent requests of equal shapes run in one forward
(`--max_batch`); such a reply differs from a lone one by float rounding (~3e-8), `--max_batch 1` is exact.

Access: `--host` defaults to 0.0.0.0 (all interfaces, as openpi's server does); with `--api_key` or `HF_VLA_API_KEY`
set, a websocket handshake without the header `Authorization: Api-Key <key>` (what openpi-client sends for
`WebsocketClientPolicy(..., api_key=...)`; `Bearer <key>` is accepted too) is refused with HTTP 401 and logged.

Real-time chunking: a request with `rtc/inference_delay` d and `rtc/executed_steps` s (actions of the previous chunk
this connection returned that were executed when the observation was taken) gets a chunk that continues that one: its
first d actions are the previous chunk's s..s+d-1 (they execute while the server works) and the next ones blend into
it; switch to the new chunk at index d. `rtc/prev_chunk_left_over` ([steps, action_dim], un-normalised) may be sent
instead of `rtc/executed_steps`, `rtc/execution_horizon` overrides the server's. An optional `head` selects the
normalisation head per request. An optional integer `episode_seed` starts a new episode: the connection's noise
generator is seeded with it and the previous chunk forgotten (`hf_vla.evaluate --server` sends it, so a remote episode
is the same function of its seed as an in-process one) and, for a MEM policy, forgets the past observations.

Observation memory (MEM checkpoints, docs/memory.md): each connection keeps its episode's past observations, one per
control step at the data's fps (the contract's `memory`). A request is one step; at the steps where the robot needs no
chunk, send the observation with `observe_only: true` (reply `{"observed": true}`, no inference), so the past matches
training's frames.

The server's metadata carries the checkpoint's deployment contract under `deployment` (`hf_vla.deployment.contract`: cameras
with their recorded sizes, actions per chunk, heads, benchmark settings), and its cameras default to the contract's.
"""


from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hf_vla.cli import run
from hf_vla.parser import CommandParser
from hf_vla.serving.arguments import RTCArguments, ServeArguments

if TYPE_CHECKING:
    pass

logger = logging.getLogger("hf_vla.serve")

def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    args, rtc = CommandParser("python -m hf_vla.serve", (ServeArguments, RTCArguments), __doc__).parse(argv)
    from hf_vla.cli import setup_logging
    from hf_vla.serving.launch import serve_checkpoint

    setup_logging()
    serve_checkpoint(args, rtc)


def cli(argv=None):
    return run("hf_vla.serve", main, argv)


if __name__ == "__main__":
    cli()
