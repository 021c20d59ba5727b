"""Serve a checkpoint to robots over openpi's websocket policy protocol.

    python -m hf_vla.serve --checkpoint outputs/demo --port 8000
    python -m hf_vla.serve --checkpoint my/pi05-droid --head droid::joint_velocity \\
        --cameras observation/exterior_image_1_left observation/wrist_image_left \\
        --state observation/joint_position observation/gripper_position

The protocol is openpi's (`openpi_client.websocket_client_policy.WebsocketClientPolicy` connects unmodified): on
connect the server sends its metadata; then each binary message is a msgpack-numpy observation dict (camera images
HxWx3 uint8, state arrays, `prompt`) and the reply is `{"actions": [chunk, action_dim], "server_timing": {...}}`,
actions un-normalised for the head. A request the policy cannot use (missing camera, wrong state size, unknown head)
gets a text reply naming the problem (the client raises it) and the connection stays open. `GET /healthz` answers OK.

Real-time chunking: a request with `rtc/inference_delay` d and `rtc/executed_steps` s (actions of the previous chunk
this connection returned that were executed when the observation was taken) gets a chunk that continues that one: its
first d actions are the previous chunk's s..s+d-1 (they execute while the server works) and the next ones blend into
it; switch to the new chunk at index d. `rtc/prev_chunk_left_over` ([steps, action_dim], un-normalised) may be sent
instead of `rtc/executed_steps`, `rtc/execution_horizon` overrides the server's. An optional `head` selects the
normalisation head per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import http
import json
import logging
import threading
import time
import traceback

import msgpack
import numpy as np
import torch

from .policy import ObservationMap, PolicyRunner, RequestError, add_rtc_arguments, load_policy, rtc_config_from_args

logger = logging.getLogger("hf_vla.serve")

RTC_KEYS = ("rtc/inference_delay", "rtc/executed_steps", "rtc/prev_chunk_left_over", "rtc/execution_horizon")


# ---- msgpack-numpy, the wire format of openpi_client.msgpack_numpy ---------------------------------------------------
def _pack_array(obj):
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in "VOc":
        raise ValueError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _unpack_array(obj):
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


packb = functools.partial(msgpack.packb, default=_pack_array)
unpackb = functools.partial(msgpack.unpackb, object_hook=_unpack_array)


class PolicyServer:
    """One model shared by all connections (inference serialised by a lock); a `PolicyRunner` (noise generator and
    last chunk for real-time chunking) per connection."""

    def __init__(self, runner: PolicyRunner, metadata: dict | None = None):
        self.runner = runner
        self.lock = threading.Lock()
        self.metadata = {**self.default_metadata(), **(metadata or {})}

    def default_metadata(self) -> dict:
        runner, config = self.runner, self.runner.model.config
        heads = {name: int(len(stats["actions"]["q01"])) for name, stats in runner.processor.norm_stats.items()}
        return {
            "policy": config.model_type, "chunk_size": int(config.chunk_size), "action_dims": heads,
            "default_head": runner.head, "num_inference_steps": int(config.num_inference_steps),
            "cameras": runner.obs_map.cameras, "state": runner.obs_map.state, "prompt": runner.obs_map.prompt,
            "rtc": {"execution_horizon": runner.rtc.execution_horizon,
                    "max_guidance_weight": runner.rtc.max_guidance_weight,
                    "prefix_attention_schedule": runner.rtc.prefix_attention_schedule,
                    "jacobian": runner.rtc.jacobian, "method": runner.rtc.method,
                    "trained_max_delay": getattr(runner.model.config, "rtc_max_delay", 0)},
        }

    def connection_runner(self) -> PolicyRunner:
        return dataclasses.replace(self.runner)  # the same settings; a fresh generator and no last chunk

    def infer(self, runner: PolicyRunner, message) -> dict:
        if isinstance(message, str):
            raise RequestError("expected a binary msgpack message, got text")
        try:
            request = unpackb(message)
        except Exception as error:  # msgpack raises several unrelated classes
            raise RequestError(f"not a msgpack-numpy message ({type(error).__name__}: {error})") from error
        if not isinstance(request, dict):
            raise RequestError(f"expected an observation dict, got {type(request).__name__}")
        delay = request.get("rtc/inference_delay", 0)
        start = time.monotonic()
        with self.lock:
            actions = runner(request, head=request.get("head"), inference_delay=int(np.asarray(delay).item()),
                             executed_steps=_optional_int(request.get("rtc/executed_steps")),
                             prev_chunk_left_over=request.get("rtc/prev_chunk_left_over"),
                             execution_horizon=_optional_int(request.get("rtc/execution_horizon")))
        elapsed_ms = 1000 * (time.monotonic() - start)
        reply = {"actions": actions.astype(np.float32), "policy_timing": {"infer_ms": elapsed_ms}}
        if runner.last_rtc_method is not None:  # the chunk continued the previous one: "guidance" or "prefix"
            reply["rtc/method"] = runner.last_rtc_method
        return reply

    def handler(self, connection) -> None:
        from websockets.exceptions import ConnectionClosed

        peer = connection.remote_address
        logger.info("connection from %s", peer)
        runner = self.connection_runner()
        try:
            connection.send(packb(self.metadata))
            prev_total_ms = None
            while True:
                message = connection.recv()
                start = time.monotonic()
                try:
                    reply = self.infer(runner, message)
                except RequestError as error:
                    logger.warning("bad request from %s: %s", peer, error)
                    connection.send(f"bad request: {error}")
                    continue
                except Exception as error:
                    logger.exception("inference failed for a request from %s", peer)
                    connection.send(f"inference failed: {type(error).__name__}: {error}\n{traceback.format_exc()}")
                    continue
                reply["server_timing"] = {"infer_ms": reply["policy_timing"]["infer_ms"]}
                if prev_total_ms is not None:
                    reply["server_timing"]["prev_total_ms"] = prev_total_ms
                connection.send(packb(reply))
                prev_total_ms = 1000 * (time.monotonic() - start)
        except ConnectionClosed:
            logger.info("connection from %s closed", peer)

    @staticmethod
    def process_request(connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    def serve(self, host: str = "0.0.0.0", port: int = 8000, ready=None) -> None:
        """Serve until interrupted; `ready(port)` is called once listening (port 0 picks a free one)."""
        from websockets.sync.server import serve

        with serve(self.handler, host, port, compression=None, max_size=None,
                   process_request=self.process_request) as server:
            bound = server.socket.getsockname()[1]
            logger.info("serving %s on ws://%s:%d", self.metadata["policy"], host, bound)
            print(f"hf_vla.serve: listening on ws://{host}:{bound}", flush=True)
            if ready is not None:
                ready(bound)
            server.serve_forever()


def _optional_int(value):
    if value is None:
        return None
    try:
        return int(np.asarray(value).item())
    except (TypeError, ValueError) as error:
        raise RequestError(f"expected an integer, got {value!r}") from error


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hf_vla.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="model + processor directory or Hub id")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--head", default=None, help="normalization head robot_type::control_mode (default: the "
                        "processor's only one; a request may name another under `head`)")
    parser.add_argument("--obs_map", default=None, help="JSON file {cameras: [...], state: [...], prompt: key}")
    parser.add_argument("--cameras", nargs="*", default=None, help="image keys in camera-slot order (default: every "
                        "HxWx3 array of the observation, sorted)")
    parser.add_argument("--state", nargs="*", default=None, help="state keys, concatenated (default: the first of "
                        "observation/state, observation.state, state)")
    parser.add_argument("--prompt_key", default=None, help="key of the task string (default: prompt)")
    parser.add_argument("--num_camera_slots", type=int, default=None, help="pad with masked cameras up to this many")
    add_rtc_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of every connection")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    obs_map = ObservationMap.from_json(args.obs_map) if args.obs_map else ObservationMap()
    for field_name, value in (("cameras", args.cameras), ("state", args.state), ("prompt", args.prompt_key)):
        if value:
            setattr(obs_map, field_name, value)
    runner = load_policy(args.checkpoint, device=args.device, obs_map=obs_map, seed=args.seed,
                         rtc=rtc_config_from_args(args),
                         num_camera_slots=args.num_camera_slots)
    heads = runner.processor.head_names
    if args.head is not None or len(heads) == 1:
        try:  # an unknown head fails here, before listening
            runner.head = runner.head_name(args.head)
        except RequestError as error:
            parser.error(f"--head: {error}")
    else:
        logger.warning("several heads %s and no --head: every request must name its `head`", heads)
    server = PolicyServer(runner, metadata={"checkpoint": str(args.checkpoint)})
    logger.info("metadata %s", json.dumps(server.metadata))
    try:
        server.serve(args.host, args.port)
    except KeyboardInterrupt:
        logger.info("stopped")


if __name__ == "__main__":
    main()


__all__ = ["PolicyServer", "packb", "unpackb", "main"]
