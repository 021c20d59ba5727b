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
is the same function of its seed as an in-process one).

The server's metadata carries the checkpoint's deployment contract under `deployment` (`hf_vla.deployment.contract`: cameras
with their recorded sizes, actions per chunk, heads, benchmark settings), and its cameras default to the contract's.
"""


from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import TYPE_CHECKING

from hf_vla.cli import resolve_device, run
from hf_vla.errors import ConfigError, ConnectionFailedError
from hf_vla.parser import CommandParser
from hf_vla.serving.arguments import RTCArguments, ServeArguments
from hf_vla.serving.limits import API_KEY_ENV

if TYPE_CHECKING:
    from hf_vla.serving.policy import ObservationMap, PolicyRunner

logger = logging.getLogger("hf_vla.serve")

# the serving layers, importable from here as before; loaded on first use so --help answers without torch
_LAYERS = {
    "Batcher": "batcher", "RefusedArray": "codec", "packb": "codec", "refused_arrays": "codec", "unpackb": "codec",
    "InputLimits": "policy", "ObservationMap": "policy", "PolicyRunner": "policy", "RequestError": "policy",
    "check_cfg_beta": "policy", "load_policy": "policy", "CONNECTION_MEMORY_FACTOR": "limits", "CONTROL_KEYS": "server",
    "MAX_CONNECTIONS_CAP": "limits", "PolicyServer": "server", "_Session": "server",
    "default_max_connections": "limits", "default_max_message_mb": "limits", "quiet_keepalive_failures": "server",
}


def __getattr__(name):
    if name in _LAYERS:
        import importlib

        return getattr(importlib.import_module(f"hf_vla.serving.{_LAYERS[name]}"), name)
    raise AttributeError(f"module 'hf_vla.serve' has no attribute {name!r}")


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    args, rtc = CommandParser("python -m hf_vla.serve", (ServeArguments, RTCArguments), __doc__).parse(argv)
    from hf_vla.serving.policy import ObservationMap
    try:
        obs_map = ObservationMap.from_json(args.obs_map) if args.obs_map else ObservationMap()
    except ValueError as error:
        raise ConfigError(f"--obs_map: {error}") from error
    from hf_vla.cli import setup_logging

    setup_logging()
    for field_name, value in (("cameras", args.cameras), ("state", args.state), ("prompt", args.prompt_key)):
        if value:
            setattr(obs_map, field_name, value)
    contract, slots = _contract_cameras(args, obs_map)
    record_lock = None
    if args.record:  # before the model loads: a directory of another run, or of a live server, is refused at once
        from hf_vla.serving.recorder import check_record_dir
        from hf_vla.serving.recorder import record_lock as writer_lock

        check_record_dir(args.record, _record_run(args))
        record_lock = writer_lock(args.record).acquire()
    try:
        _serve(args, rtc, obs_map, contract, slots, record_lock)
    finally:
        if record_lock is not None:
            record_lock.release()


def _check_guidance(runner, cfg_beta, max_cfg_beta) -> None:
    """`--cfg_beta` within [0, --max_cfg_beta], and only for an advantage-conditioned policy (before listening)."""
    if not (math.isfinite(max_cfg_beta) and max_cfg_beta >= 0):
        raise ConfigError(f"--max_cfg_beta {max_cfg_beta}: a finite number >= 0")
    if cfg_beta is None:
        return
    if not (math.isfinite(cfg_beta) and 0 <= cfg_beta <= max_cfg_beta):
        raise ConfigError(f"--cfg_beta {cfg_beta}: a number in [0, {max_cfg_beta:g}] (--max_cfg_beta)")
    from hf_vla.serving.policy import check_cfg_beta

    check_cfg_beta("--cfg_beta", cfg_beta, runner)


def _serve(args, rtc, obs_map, contract, slots, record_lock):
    """Load the policy and serve it until stopped (the recording, if any, joined at the end)."""
    from hf_vla.serving.policy import InputLimits, RequestError, load_policy
    from hf_vla.serving.server import PolicyServer

    runner = load_policy(args.checkpoint, device=resolve_device(args.device), revision=args.revision, obs_map=obs_map, seed=args.seed,
                         rtc=rtc.rtc_config(), num_camera_slots=slots, cfg_beta=args.cfg_beta,
                         limits=InputLimits(max_image_side=args.max_image_side, max_state_range=args.max_state_range))
    _check_guidance(runner, args.cfg_beta, args.max_cfg_beta)
    heads = runner.processor.head_names
    if args.head is not None or len(heads) == 1:
        try:  # an unknown head fails here, before listening
            runner.head = runner.head_name(args.head)
        except RequestError as error:
            raise ConfigError(f"--head: {error}") from None
    else:
        logger.warning("several heads %s and no --head: every request must name its `head`", heads)
    metadata = {"checkpoint": str(args.checkpoint), "deployment": contract.to_dict() if contract else None}
    recorder = _recorder(args, contract, runner, record_lock) if args.record else None
    server = PolicyServer(runner, metadata=metadata, max_message_mb=args.max_message_mb,
                          api_key=args.api_key or os.environ.get(API_KEY_ENV), max_batch=args.max_batch,
                          max_connections=args.max_connections, recorder=recorder, max_cfg_beta=args.max_cfg_beta)
    logger.info("metadata %s", json.dumps(server.metadata))
    import signal

    def stop(signum, frame):  # `docker stop`, systemd: stop as on Ctrl-C (the recording is joined)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
    try:
        server.serve(args.host, args.port)
    except KeyboardInterrupt:
        logger.info("stopped")
    except OSError as error:  # the port is taken, the host is not an address of this machine
        raise ConnectionFailedError(f"cannot listen on {args.host}:{args.port}: {error}") from error
    finally:
        if recorder is not None:
            joined = recorder.close()
            if joined is not None:
                print(f"hf_vla.serve: recorded episodes joined into {joined}", flush=True)


def _record_run(args) -> dict:
    """What identifies a recording's run: the checkpoint (a local one by its resolved path and its weights'
    fingerprint, so another spelling of it is the same run and other weights under its path are not) and revision."""
    from hf_vla.serving.recorder import checkpoint_identity
    from hf_vla.storage import weights_fingerprint

    return {"checkpoint": checkpoint_identity(str(args.checkpoint)), "revision": args.revision,
            "weights": weights_fingerprint(args.checkpoint)}


def _recorder(args, contract, runner: PolicyRunner, lock=None):
    """The `--record` writer: the run is the checkpoint and head; one frame per request, at the data's fps divided by
    the actions executed per chunk unless --record_fps says (rounded to a whole fps, with a warning, where that is not
    whole)."""
    from hf_vla.serving.recorder import ServeRecorder

    fps = args.record_fps  # whole: ServeArguments checked it
    spec = (contract.heads.get(runner.head) if contract and runner.head else None) or {}
    if fps is None:
        rate = (spec.get("fps") or 10.0) / (contract.n_action_steps if contract and spec.get("fps") else 1)
        fps = max(1, round(rate))
        if fps != rate:
            logger.warning("recording at %d fps: one request per %g s is %g per second at the data's fps and the "
                           "contract's actions per chunk, and a LeRobot dataset's fps is whole (--record_fps sets it)",
                           fps, 1 / rate, rate)
    run = _record_run(args) | {"head": runner.head, "robot_type": spec.get("robot_type")}
    if getattr(runner.processor, "advantage_conditioned", False):  # RECAP: what the policy was asked for
        run["advantage"] = {"indicator": "positive", "cfg_beta": runner.cfg_beta if runner.cfg_beta is not None
                            else runner.processor.cfg_beta, "max_cfg_beta": args.max_cfg_beta}
    return ServeRecorder(args.record, run, fps, lock=lock)


def _contract_cameras(args, obs_map: ObservationMap):
    """The checkpoint's deployment contract and the camera slots to serve (`evaluation.settings.served_cameras`)."""
    from hf_vla.envs.settings import served_cameras
    from hf_vla.hub.resolve import resolve_contract

    contract = resolve_contract(args.checkpoint, args.revision)
    obs_map.cameras, slots = served_cameras(contract, args.head, obs_map.cameras, args.num_camera_slots,
                                            args.override)
    return contract, slots


def cli(argv=None):
    return run("hf_vla.serve", main, argv)


if __name__ == "__main__":
    cli()


__all__ = ["Batcher", "PolicyServer", "RefusedArray", "refused_arrays", "default_max_connections", "default_max_message_mb", "packb", "unpackb", "main"]  # noqa: F822  (lazy: __getattr__)

