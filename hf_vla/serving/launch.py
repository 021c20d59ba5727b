"""How `python -m hf_vla.serve` runs: the policy loaded with its contract's cameras and served until stopped, with the
`--record` writer and the guidance checks; `serve_checkpoint` is the command's body, callable from Python."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import TYPE_CHECKING

from hf_vla.cli import resolve_device
from hf_vla.errors import ConfigError, ConnectionFailedError
from hf_vla.serving.arguments import RTCArguments, ServeArguments
from hf_vla.serving.limits import API_KEY_ENV

if TYPE_CHECKING:
    from hf_vla.serving.policy import ObservationMap, PolicyRunner

logger = logging.getLogger("hf_vla.serve")


def serve_checkpoint(args: ServeArguments, rtc: RTCArguments) -> None:
    """Serve `args.checkpoint` as `python -m hf_vla.serve` does, until stopped: the observation map and the contract's
    cameras resolved, a `--record` directory checked and locked before the model loads, the policy loaded and served
    (the recording joined at the end)."""
    from hf_vla.serving.policy import ObservationMap

    try:
        obs_map = ObservationMap.from_json(args.obs_map) if args.obs_map else ObservationMap()
    except ValueError as error:
        raise ConfigError(f"--obs_map: {error}") from error
    for field_name, value in (("cameras", args.cameras), ("state", args.state), ("prompt", args.prompt_key)):
        if value:
            setattr(obs_map, field_name, value)
    contract, slots = _contract_cameras(args, obs_map)
    record_lock = None
    if args.record:  # before the model loads: a directory of another run, or of a live server, is refused at once
        from hf_vla.serving.recorder import check_record_dir
        from hf_vla.serving.recorder import record_lock as writer_lock

        check_record_dir(args.record, record_run(args))
        record_lock = writer_lock(args.record).acquire()
    try:
        _serve(args, rtc, obs_map, contract, slots, record_lock)
    finally:
        if record_lock is not None:
            record_lock.release()


def _check_guidance(runner, cfg_beta, max_cfg_beta) -> None:
    """`--cfg_beta` within [0, --max_cfg_beta], and only for an advantage-conditioned policy (before listening)."""
    from hf_vla.models.common.flow import MAX_CFG_BETA

    if not (math.isfinite(max_cfg_beta) and 0 <= max_cfg_beta <= MAX_CFG_BETA):
        raise ConfigError(f"--max_cfg_beta {max_cfg_beta}: a number in [0, {MAX_CFG_BETA:g}] (guidance beyond "
                          "leaves any action range)")
    if cfg_beta is None:
        return
    if not (math.isfinite(cfg_beta) and 0 <= cfg_beta <= max_cfg_beta):
        raise ConfigError(f"--cfg_beta {cfg_beta}: a number in [0, {max_cfg_beta:g}] (--max_cfg_beta)")
    from hf_vla.serving.policy import check_cfg_beta

    check_cfg_beta("--cfg_beta", cfg_beta, runner)


def _serve(args, rtc, obs_map, contract, slots, record_lock):
    """Load the policy and serve it until stopped (the recording, if any, joined at the end)."""
    from hf_vla.serving.critic import plan_best_of
    from hf_vla.serving.policy import InputLimits, RequestError, load_policy
    from hf_vla.serving.server import PolicyServer

    best_of = plan_best_of(args.best_of, args.selector, args.critic, contract, args.checkpoint, args.revision)
    if args.max_best_of is not None and args.max_best_of < best_of.best_of:
        raise ConfigError(f"--max_best_of {args.max_best_of} is below the checkpoint's best-of-{best_of.best_of}")
    runner = load_policy(args.checkpoint, device=resolve_device(args.device), revision=args.revision, obs_map=obs_map, seed=args.seed,
                         rtc=rtc.rtc_config(), num_camera_slots=slots, cfg_beta=args.cfg_beta,
                         **best_of.runner_kwargs(resolve_device(args.device)),
                         limits=InputLimits(max_image_side=args.max_image_side, max_state_range=args.max_state_range,
                                            max_best_of=args.max_best_of))
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


def record_run(args) -> dict:
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
    run = record_run(args) | {"head": runner.head, "robot_type": spec.get("robot_type")}
    if getattr(runner.processor, "advantage_conditioned", False):  # RECAP: what the policy was asked for
        run["advantage"] = {"indicator": "positive", "cfg_beta": runner.cfg_beta if runner.cfg_beta is not None
                            else runner.processor.cfg_beta, "max_cfg_beta": args.max_cfg_beta}
    return ServeRecorder(args.record, run, fps, lock=lock)


def _contract_cameras(args, obs_map: ObservationMap):
    """The checkpoint's deployment contract and the camera slots to serve (`served_cameras`)."""
    from hf_vla.deployment.contract import served_cameras
    from hf_vla.hub.resolve import resolve_contract

    contract = resolve_contract(args.checkpoint, args.revision)
    obs_map.cameras, slots = served_cameras(contract, args.head, obs_map.cameras, args.num_camera_slots,
                                            args.override)
    return contract, slots


__all__ = ["record_run", "serve_checkpoint"]
