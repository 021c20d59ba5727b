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

The server's metadata carries the checkpoint's deployment contract under `deployment` (`hf_vla.serving.contract`: cameras
with their recorded sizes, actions per chunk, heads, benchmark settings), and its cameras default to the contract's.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import http
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future

import msgpack
import numpy as np
import torch

from hf_vla.cli import ArgumentParser, model_source, run
from hf_vla.errors import ConfigError, ConnectionFailedError
from hf_vla.serving.policy import (
    InputLimits,
    ObservationMap,
    PolicyRunner,
    PreparedRequest,
    RequestError,
    add_rtc_arguments,
    load_policy,
    rtc_config_from_args,
    sample_batch,
)

logger = logging.getLogger("hf_vla.serve")

RTC_KEYS = ("rtc/inference_delay", "rtc/executed_steps", "rtc/prev_chunk_left_over", "rtc/execution_horizon")
API_KEY_ENV = "HF_VLA_API_KEY"
# The default message bound: room for every camera's image at 1920x1080 in float32 (uint8 needs a quarter), plus 1 MiB
# for the state, prompt and RTC fields. pi0.5 is published with 3 camera slots.
DEFAULT_CAMERA_BYTES = 1920 * 1080 * 3 * 4
DEFAULT_CAMERAS = 3


# What one connection can hold at its worst, in multiples of the message bound: the frame websockets is receiving, the
# assembled message, the decoded copy of its images and the pre-processing's temporaries. Measured peak growth per
# connection (benchmarks/serve_load.py --memory, 48 MiB float32 images): 5.0x for 1 client, 4.3x for 4, 3.3x for 8.
CONNECTION_MEMORY_FACTOR = 6
MAX_CONNECTIONS_CAP = 256


def default_max_message_mb(num_cameras: int | None) -> float:
    return math.ceil((num_cameras or DEFAULT_CAMERAS) * DEFAULT_CAMERA_BYTES / 2**20) + 1


def default_max_connections(max_message_mb: float, available_bytes: int | None = None) -> int:
    """As many connections as half the memory available now holds when every one of them sends a message of
    `max_message_mb` at once (`CONNECTION_MEMORY_FACTOR` x the bound each); at least 1, at most 256."""
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    per_connection = CONNECTION_MEMORY_FACTOR * max_message_mb * 2**20
    return int(min(MAX_CONNECTIONS_CAP, max(1, available_bytes // 2 // per_connection)))


# ---- msgpack-numpy, the wire format of openpi_client.msgpack_numpy ---------------------------------------------------
def _pack_array(obj):
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in "VOc":
        raise ValueError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


# What a request's arrays may be: plain numbers. numpy builds an array of any dtype over the received bytes, and an
# object dtype (or a structured one with an object field) turns them into pointers that crash the process when read;
# strings, dates, void and complex numbers mean nothing to a policy. 16-byte floats (long double) torch cannot take.
WIRE_KINDS = "biuf"
MAX_WIRE_DIMS = 8


def _wire_dtype(spec) -> np.dtype:
    """The dtype of a received array or scalar, refused unless it is a plain bool/int/float (any byte order)."""
    if isinstance(spec, bytes):
        spec = spec.decode("ascii", "replace")
    if not isinstance(spec, str):  # a dict/list spec builds a structured dtype
        raise RequestError(f"array dtype must be a numpy type string such as '<f4', got a {type(spec).__name__}")
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError) as error:
        raise RequestError(f"array dtype {spec[:40]!r} is not a numpy dtype") from error
    if (dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in WIRE_KINDS
            or dtype.itemsize > 8):
        raise RequestError(f"array dtype {spec[:40]!r} ({dtype.kind!r} kind): only bool, integer and float arrays "
                           f"(up to 64 bits) are accepted")
    return dtype


@dataclasses.dataclass(frozen=True)
class RefusedArray:
    """What the decoder puts in place of an array or numpy scalar it will not build (`reason` says why); the server
    answers a request holding one as a bad request naming its key."""

    reason: str


def _unpack_array(obj):
    """openpi_client.msgpack_numpy's decoding, with the client's dtype and shape checked before a byte is read as an
    array: anything but a plain numeric array whose shape fits its bytes becomes a `RefusedArray`."""
    try:
        return _decode_array(obj)
    except RequestError as error:
        return RefusedArray(str(error))


def refused_arrays(value, key: str = "", depth: int = 0):
    """(key path, reason) of every `RefusedArray` in a decoded message (dicts and lists, a few levels deep)."""
    if isinstance(value, RefusedArray):
        yield key or "message", value.reason
    elif depth < 4 and isinstance(value, dict):
        for name, item in value.items():
            yield from refused_arrays(item, f"{key}.{name}" if key else str(name), depth + 1)
    elif depth < 4 and isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from refused_arrays(item, f"{key}[{index}]", depth + 1)


def _decode_array(obj):
    if b"__ndarray__" in obj:
        dtype = _wire_dtype(obj.get(b"dtype"))
        data, shape = obj.get(b"data"), obj.get(b"shape")
        if not isinstance(data, bytes):
            raise RequestError(f"array data must be bytes, got {type(data).__name__}")
        if (not isinstance(shape, list | tuple) or len(shape) > MAX_WIRE_DIMS
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
            raise RequestError(f"array shape must be a list of at most {MAX_WIRE_DIMS} non-negative integers, got "
                               f"{str(shape)[:80]}")
        if math.prod(shape) * dtype.itemsize != len(data):
            raise RequestError(f"array of shape {tuple(shape)[:MAX_WIRE_DIMS]} and dtype {dtype.str} needs "
                               f"{math.prod(shape) * dtype.itemsize} bytes, the message has {len(data)}")
        array = np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))
    if b"__npgeneric__" in obj:
        dtype = _wire_dtype(obj.get(b"dtype"))
        value = obj.get(b"data")
        # a numpy bool (openpi's client sends `np.bool_(True)` as one) carries a Python bool; numbers carry numbers
        if (isinstance(value, bool) and dtype.kind != "b") or not isinstance(value, int | float):
            raise RequestError(f"numpy scalar data must be a number, got {type(value).__name__}")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError) as error:
            raise RequestError(f"numpy scalar {value!r} does not fit {dtype.str}") from error
    return obj


packb = functools.partial(msgpack.packb, default=_pack_array)
unpackb = functools.partial(msgpack.unpackb, object_hook=_unpack_array)


class Batcher:
    """One thread runs the model. Requests that arrive while it is busy wait in a queue; the next forward takes all of
    them that can share one (`PreparedRequest.batch_key`: same input shapes, no RTC), up to `max_batch` rows. So a
    lone client is served at once, and N clients cost about one forward instead of N (`benchmarks/serve_load.py`)."""

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


class PolicyServer:
    """One model shared by all connections, run by a `Batcher` thread; a `PolicyRunner` (noise generator and last chunk
    for real-time chunking) per connection, which validates and pre-processes its requests on the connection's thread.

    max_message_mb: the largest message read (larger ones are refused unread); None: `default_max_message_mb`.
    max_batch: most requests of waiting clients run in one forward (1: one at a time).
    api_key: required at the websocket handshake when set (`Authorization: Api-Key <key>` or `Bearer <key>`).
    max_connections: open connections at most; a client beyond them is refused at the handshake (HTTP 503) and may
        retry later. None: `default_max_connections` (what half the available memory holds at the worst case).
    """

    def __init__(self, runner: PolicyRunner, metadata: dict | None = None, max_message_mb: float | None = None,
                 api_key: str | None = None, max_batch: int = 8, max_connections: int | None = None,
                 recorder=None):
        self.runner = runner
        self.recorder = recorder  # a `hf_vla.serving.recorder.ServeRecorder`: what clients sent and got, as episodes
        self.batcher = Batcher(runner.model, runner.device, max_batch)
        cameras = len(runner.obs_map.cameras) if runner.obs_map.cameras else runner.num_camera_slots
        self.max_message_mb = max_message_mb or default_max_message_mb(cameras)
        self.max_connections = int(max_connections or default_max_connections(self.max_message_mb))
        self._open = 0  # connections being served
        self._open_lock = threading.Lock()
        self.api_key = api_key or None
        self.metadata = {**self.default_metadata(), **(metadata or {})}

    def default_metadata(self) -> dict:
        runner, config = self.runner, self.runner.model.config
        from hf_vla.serving.policy import stat_dims

        heads = {name: stat_dims(stats["actions"]) for name, stats in runner.processor.norm_stats.items()}
        return {
            "policy": config.model_type, "chunk_size": int(config.chunk_size), "action_dims": heads,
            "default_head": runner.head, "num_inference_steps": int(config.num_inference_steps),
            "cameras": runner.obs_map.cameras, "state": runner.obs_map.state, "prompt": runner.obs_map.prompt,
            "rtc": {"execution_horizon": runner.rtc.execution_horizon,
                    "max_guidance_weight": runner.rtc.max_guidance_weight,
                    "prefix_attention_schedule": runner.rtc.prefix_attention_schedule,
                    "jacobian": runner.rtc.jacobian, "method": runner.rtc.method,
                    "trained_max_delay": getattr(runner.model.config, "rtc_max_delay", 0)},
            "limits": {"max_message_mb": self.max_message_mb, "max_connections": self.max_connections,
                       **dataclasses.asdict(runner.limits)},
            "max_batch": self.batcher.max_batch,
            "record": self.recorder is not None,
        }

    def connection_runner(self) -> PolicyRunner:
        return dataclasses.replace(self.runner)  # the same settings; a fresh generator and no last chunk

    def infer(self, runner: PolicyRunner, message, session: _Session | None = None) -> dict:
        session = session if session is not None else _Session()
        if isinstance(message, str):
            raise RequestError("expected a binary msgpack message, got text")
        try:
            request = unpackb(message)
        except Exception as error:  # msgpack raises several unrelated classes
            raise RequestError(f"not a msgpack-numpy message ({type(error).__name__}: {error})") from error
        refused = next(refused_arrays(request), None)  # checked before any value is read
        if refused is not None:
            raise RequestError(f"{refused[0][:100]}: {refused[1]}")
        if not isinstance(request, dict):
            raise RequestError(f"expected an observation dict, got {type(request).__name__}")
        not_text = [key for key in request if not isinstance(key, str)]
        if not_text:
            raise RequestError(f"observation keys must be strings, got {not_text[:3]!r}")
        head = request.get("head")
        if head is not None and not isinstance(head, str):
            raise RequestError(f"head: expected a string robot_type::control_mode, got {type(head).__name__}")
        episode_seed = _optional_int(request.get("episode_seed"), "episode_seed")
        episode_end = _optional_bool(request.get("episode_end"), "episode_end")
        success = _optional_bool(request.get("success"), "success")
        if success is not None and not episode_end:
            raise RequestError("success: sent with episode_end true (the outcome of the episode that ends)")
        if episode_seed is not None:  # a new episode (clients send it at an episode's start, the same seed or
            runner.reset(seed=episode_seed)  # another): its noise from this seed, no chunk to continue
            self._end_episode(session, None, "a new episode_seed")
            session.seed = episode_seed
        if set(request) <= CONTROL_KEYS:  # no observation: an episode's end (or start) alone, no inference
            episode = session.episode
            if episode_end:
                self._end_episode(session, success, "episode_end")
            return {"episode_end": bool(episode_end), "recorded_episode": episode}
        delay = _optional_int(request.get("rtc/inference_delay", 0), "rtc/inference_delay")
        start = time.monotonic()
        prepared = runner.prepare(request, head=head, inference_delay=delay,
                                  executed_steps=_optional_int(request.get("rtc/executed_steps"), "rtc/executed_steps"),
                                  prev_chunk_left_over=request.get("rtc/prev_chunk_left_over"),
                                  execution_horizon=_optional_int(request.get("rtc/execution_horizon"),
                                                                  "rtc/execution_horizon"))
        intervention = _intervention(request.get("intervention"), runner, prepared.head)
        actions = runner.finish(prepared, self.batcher.submit(prepared))
        elapsed_ms = 1000 * (time.monotonic() - start)
        if not np.isfinite(actions).all():  # never send a robot a NaN action, whatever went wrong upstream
            raise FloatingPointError("the policy produced a non-finite action")
        reply = {"actions": actions.astype(np.float32), "policy_timing": {"infer_ms": elapsed_ms}}
        if runner.last_rtc_method is not None:  # the chunk continued the previous one: "guidance" or "prefix"
            reply["rtc/method"] = runner.last_rtc_method
        if self.recorder is not None:
            self._record(runner, session, request, actions[min(delay or 0, len(actions) - 1)], intervention)
            reply["recorded_episode"] = session.episode
        if episode_end:
            self._end_episode(session, success, "episode_end")
        return reply

    # ---- recording (--record) -------------------------------------------------------------------------------------
    def _record(self, runner: PolicyRunner, session: _Session, request: dict, policy_action: np.ndarray,
                intervention: np.ndarray | None) -> None:
        from hf_vla.serving.recorder import Frame

        if session.episode is None:
            session.episode = self.recorder.start_episode()
        images = {key: _as_uint8_hwc(request[key]) for key in runner.obs_map.camera_keys(request)}
        self.recorder.add(session.episode, Frame(
            images, runner.obs_map.state_vector(request), runner.obs_map.task(request, runner.limits),
            policy_action.astype(np.float32), intervention if intervention is not None else policy_action,
            intervention is not None))

    def _end_episode(self, session: _Session, success: bool | None, reason: str) -> None:
        if self.recorder is not None and session.episode is not None:
            self.recorder.end(session.episode, success, reason)
        session.episode = None

    def handler(self, connection) -> None:
        peer = _peer(connection)
        if peer is None:  # the client left before the handler started: nothing to serve, nothing went wrong
            logger.info("a client disconnected before it was served")
            return
        with self._open_lock:  # the handshake's check (process_request) can race; this one cannot
            full = self._open >= self.max_connections
            self._open += not full
        if full:
            logger.warning("refused a connection from %s: %d connections open (--max_connections %d)", peer,
                           self.max_connections, self.max_connections)
            connection.close(1013, f"server full: --max_connections {self.max_connections}; try again later")
            return
        logger.info("connection from %s (%d open)", peer, self._open)
        try:
            self._serve_connection(connection, peer)
        finally:
            with self._open_lock:
                self._open -= 1

    def _serve_connection(self, connection, peer: str) -> None:
        from websockets.exceptions import ConnectionClosed

        runner = self.connection_runner()
        session = _Session()
        try:
            connection.send(packb(self.metadata))
            prev_total_ms = None
            while True:
                message = connection.recv()
                start = time.monotonic()
                request_id = uuid.uuid4().hex[:12]
                try:
                    reply = self.infer(runner, message, session)
                except RequestError as error:
                    logger.warning("request %s from %s refused: %s", request_id, peer, error)
                    connection.send(f"bad request (request {request_id}): {error}")
                    continue
                except Exception:
                    # the reply names the request; the traceback (paths, versions) stays in this log
                    logger.exception("request %s from %s: inference failed", request_id, peer)
                    connection.send(f"inference failed (request {request_id}): internal server error; the server "
                                    f"log has the details under this request id")
                    continue
                if "policy_timing" in reply:  # an inference (not an episode's end alone)
                    reply["server_timing"] = {"infer_ms": reply["policy_timing"]["infer_ms"]}
                    if prev_total_ms is not None:
                        reply["server_timing"]["prev_total_ms"] = prev_total_ms
                connection.send(packb(reply))
                prev_total_ms = 1000 * (time.monotonic() - start)
        except ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == 1009:
                logger.warning("connection from %s closed: %s (--max_message_mb %g)", peer, closed.sent.reason,
                               self.max_message_mb)
            else:
                logger.info("connection from %s closed", peer)
        finally:
            self._end_episode(session, None, "client disconnected")

    def process_request(self, connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self.api_key is not None and not self._authorized(request.headers.get("Authorization")):
            logger.warning("refused a connection from %s: %s API key", _peer(connection) or "a client that left",
                           "wrong" if request.headers.get("Authorization") else "no")
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong API key\n")
        if self._open >= self.max_connections:
            logger.warning("refused a connection from %s: %d connections open (--max_connections %d)",
                           _peer(connection) or "a client that left", self._open, self.max_connections)
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"server full: {self._open} connections open, --max_connections "
                                      f"{self.max_connections}; try again later\n")
        return None

    def _authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() in ("api-key", "bearer") and hmac.compare_digest(token.strip().encode(),
                                                                              self.api_key.encode())

    def serve(self, host: str = "0.0.0.0", port: int = 8000, ready=None) -> None:
        """Serve until interrupted; `ready(port)` is called once listening (port 0 picks a free one)."""
        from websockets.sync.server import serve

        quiet_keepalive_failures()

        with serve(self.handler, host, port, compression=None, max_size=int(self.max_message_mb * 2**20),
                   process_request=self.process_request) as server:
            self._server = server
            bound = server.socket.getsockname()[1]
            logger.info("serving %s on ws://%s:%d (messages up to %g MB, %d connections at most: %.1f GB at their "
                        "worst, %s)", self.metadata["policy"], host, bound, self.max_message_mb, self.max_connections,
                        self.max_connections * CONNECTION_MEMORY_FACTOR * self.max_message_mb / 1024,
                        "API key required" if self.api_key else "no API key")
            if self.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
                logger.warning("listening on %s without an API key: anyone who reaches port %d can drive this policy "
                               "(set %s, or --host 127.0.0.1)", host, bound, API_KEY_ENV)
            print(f"hf_vla.serve: listening on ws://{host}:{bound}", flush=True)
            if ready is not None:
                ready(bound)
            server.serve_forever()

    def shutdown(self) -> None:
        """Stop a `serve` running on another thread (it returns once the listening socket is closed)."""
        if getattr(self, "_server", None) is not None:
            self._server.shutdown()


def _peer(connection) -> str | None:
    """`host:port` of the client, or None when it has already disconnected (the socket has no peer any more)."""
    try:
        host, port = connection.remote_address[:2]
    except OSError:
        return None
    return f"{host}:{port}"


class _KeepaliveFailure(logging.Filter):
    """websockets logs "keepalive ping failed" with a traceback (ERROR) when a ping meets a connection that is already
    closing, e.g. one the server just closed for an oversized message: nothing failed that the connection's own close
    does not report. The record becomes one INFO line naming the exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "keepalive ping failed" and record.exc_info:
            kind, error = record.exc_info[0], record.exc_info[1]
            record.msg, record.args = "keepalive ping on a closing connection failed (%s: %s)", (
                getattr(kind, "__name__", kind), error)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_keepalive_failures() -> None:
    """Install `_KeepaliveFailure` on websockets' server logger (once)."""
    server_logger = logging.getLogger("websockets.server")
    if not any(isinstance(f, _KeepaliveFailure) for f in server_logger.filters):
        server_logger.addFilter(_KeepaliveFailure())


@dataclasses.dataclass
class _Session:
    """A connection's episode: the `episode_seed` it runs and the recorder's episode it writes (None: none open)."""

    seed: int | None = None
    episode: int | None = None


CONTROL_KEYS = {"episode_seed", "episode_end", "success"}  # a message of these alone runs no inference


def _optional_bool(value, key: str):
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind == "b":
        return bool(value.item())
    raise RequestError(f"{key}: expected true or false, got {type(value).__name__}")


def _intervention(value, runner: PolicyRunner, head: str) -> np.ndarray | None:
    """The action a person executed instead of the policy's: `[action_dim]` finite numbers of the head."""
    if value is None:
        return None
    from hf_vla.serving.policy import stat_dims

    dims = stat_dims(runner.processor.norm_stats[head]["actions"])
    if not isinstance(value, np.ndarray | list | tuple) or (isinstance(value, np.ndarray) and value.dtype.kind not in
                                                           "biuf"):
        raise RequestError(f"intervention: expected an array of {dims} action values, got {type(value).__name__}")
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise RequestError(f"intervention: not numeric ({error})") from error
    if array.shape != (dims,):
        raise RequestError(f"intervention: shape {array.shape}; head {head!r} acts with {dims} values, shape ({dims},)")
    if not np.isfinite(array).all():
        raise RequestError("intervention: NaN or inf values")
    return array


def _as_uint8_hwc(image: np.ndarray) -> np.ndarray:
    """A camera image as sent (HxWx3 or 3xHxW; uint8, or floats in [0, 1]) as HxWx3 uint8 for the video."""
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[-1] != 3:
        image = image.transpose(1, 2, 0)
    if image.dtype != np.uint8:
        image = (np.clip(image.astype(np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return np.ascontiguousarray(image)


def _optional_int(value, key: str):
    if value is None:
        return None
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iu":
        return int(value.item())
    shown = repr(value)[:40] if isinstance(value, str | bytes | float | bool) else type(value).__name__
    if isinstance(value, np.ndarray):
        shown = f"an array of shape {value.shape} and dtype {value.dtype.str}"
    raise RequestError(f"{key}: expected an integer, got {shown}")


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    parser = ArgumentParser(prog="python -m hf_vla.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="model + processor directory or Hub id (a lerobot pi0.5 "
                        "checkpoint is converted on load)")
    parser.add_argument("--revision", default=None, help="Hub revision of --checkpoint")
    parser.add_argument("--host", default="0.0.0.0", help="interface to bind (default all, as openpi's server; "
                        "127.0.0.1 for this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--head", default=None, help="normalization head robot_type::control_mode (default: the "
                        "processor's only one; a request may name another under `head`)")
    parser.add_argument("--obs_map", default=None, help="JSON file {cameras: [...], state: [...], prompt: key}")
    parser.add_argument("--cameras", nargs="*", default=None, help="image keys in camera-slot order (default: the "
                        "checkpoint's contract; without one, every HxWx3 array of the observation, sorted)")
    parser.add_argument("--state", nargs="*", default=None, help="state keys, concatenated (default: the first of "
                        "observation/state, observation.state, state)")
    parser.add_argument("--prompt_key", default=None, help="key of the task string (default: prompt)")
    parser.add_argument("--num_camera_slots", type=int, default=None, help="pad with masked cameras up to this many "
                        "(default: the checkpoint's)")
    parser.add_argument("--override", nargs="+", default=[], choices=("cameras", "num_camera_slots"), metavar="FIELD",
                        help="accept --cameras / --num_camera_slots against the checkpoint's deployment contract")
    limits = parser.add_argument_group("limits and access")
    limits.add_argument("--max_message_mb", type=float, default=None, help="largest request read, in MiB (default: "
                        "every camera at 1920x1080 float32 + 1, e.g. 73 for 3 cameras)")
    limits.add_argument("--max_image_side", type=int, default=InputLimits.max_image_side,
                        help="largest image side accepted, in pixels")
    limits.add_argument("--max_state_range", type=float, default=InputLimits.max_state_range,
                        help="refuse a state value (or an RTC leftover action) this many q01..q99 widths "
                        "outside the training range")
    limits.add_argument("--max_batch", type=int, default=8, help="most requests of clients waiting at once that run "
                        "in one forward (1: one request at a time)")
    limits.add_argument("--max_connections", type=int, default=None, help="open connections at most; more are "
                        "refused at the handshake (HTTP 503) (default: what half the available memory holds when each "
                        f"sends a --max_message_mb message at once, {CONNECTION_MEMORY_FACTOR}x the bound per "
                        f"connection, at most {MAX_CONNECTIONS_CAP})")
    limits.add_argument("--api_key", default=None, help=f"require this key at the handshake (prefer the {API_KEY_ENV} "
                        "environment variable: a flag is visible in the process list)")
    recording = parser.add_argument_group("recording (hf_vla.serving.recorder)")
    recording.add_argument("--record", default=None, metavar="DIR", help="write what each client sent and got as "
                           "LeRobot episodes under DIR (a new or empty directory, or this checkpoint's earlier "
                           "recording to continue); joined into DIR/dataset when the server stops")
    recording.add_argument("--record_fps", type=float, default=None, help="frames per second of the recording (one "
                           "frame a request; default: the data's fps / the contract's actions per chunk)")
    add_rtc_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of every connection")
    args = parser.parse_args(argv)
    checkpoint = model_source("--checkpoint", args.checkpoint)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 0..65535")
    try:
        obs_map = ObservationMap.from_json(args.obs_map) if args.obs_map else ObservationMap()
    except ValueError as error:
        raise ConfigError(f"--obs_map: {error}") from error
    from hf_vla.cli import setup_logging

    setup_logging()

    for field_name, value in (("cameras", args.cameras), ("state", args.state), ("prompt", args.prompt_key)):
        if value:
            setattr(obs_map, field_name, value)
    for name in ("max_message_mb", "max_image_side", "max_state_range", "num_camera_slots", "max_batch",
                 "max_connections"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name}: must be positive, got {value}")
    contract, slots = _contract_cameras(parser, checkpoint, args, obs_map)
    record_lock = None
    if args.record:  # before the model loads: a directory of another run, or of a live server, is refused at once
        from hf_vla.serving.recorder import check_record_dir
        from hf_vla.serving.recorder import record_lock as writer_lock

        _record_fps(args.record_fps)
        check_record_dir(args.record, _record_run(args))
        record_lock = writer_lock(args.record).acquire()
    try:
        _serve(parser, args, checkpoint, obs_map, contract, slots, record_lock)
    finally:
        if record_lock is not None:
            record_lock.release()


def _serve(parser, args, checkpoint, obs_map, contract, slots, record_lock):
    """Load the policy and serve it until stopped (the recording, if any, joined at the end)."""
    runner = load_policy(checkpoint, device=args.device, revision=args.revision, obs_map=obs_map, seed=args.seed,
                         rtc=rtc_config_from_args(args), num_camera_slots=slots,
                         limits=InputLimits(max_image_side=args.max_image_side, max_state_range=args.max_state_range))
    heads = runner.processor.head_names
    if args.head is not None or len(heads) == 1:
        try:  # an unknown head fails here, before listening
            runner.head = runner.head_name(args.head)
        except RequestError as error:
            parser.error(f"--head: {error}")
    else:
        logger.warning("several heads %s and no --head: every request must name its `head`", heads)
    metadata = {"checkpoint": str(args.checkpoint), "deployment": contract.to_dict() if contract else None}
    recorder = _recorder(args, contract, runner, record_lock) if args.record else None
    server = PolicyServer(runner, metadata=metadata, max_message_mb=args.max_message_mb,
                          api_key=args.api_key or os.environ.get(API_KEY_ENV), max_batch=args.max_batch,
                          max_connections=args.max_connections, recorder=recorder)
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


def _record_fps(fps: float | None) -> int | None:
    """--record_fps: a whole number of frames per second (a LeRobot dataset's fps is one), or one line."""
    if fps is None:
        return None
    if not (math.isfinite(fps) and fps > 0):
        raise ConfigError(f"--record_fps {fps}: must be positive")
    if not float(fps).is_integer():
        raise ConfigError(f"--record_fps {fps}: a LeRobot dataset has a whole number of frames per second; give an "
                          f"integer (e.g. {max(1, round(fps))})")
    return int(fps)


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

    fps = _record_fps(args.record_fps)
    spec = (contract.heads.get(runner.head) if contract and runner.head else None) or {}
    if fps is None:
        rate = (spec.get("fps") or 10.0) / (contract.n_action_steps if contract and spec.get("fps") else 1)
        fps = max(1, round(rate))
        if fps != rate:
            logger.warning("recording at %d fps: one request per %g s is %g per second at the data's fps and the "
                           "contract's actions per chunk, and a LeRobot dataset's fps is whole (--record_fps sets it)",
                           fps, 1 / rate, rate)
    run = _record_run(args) | {"head": runner.head, "robot_type": spec.get("robot_type")}
    return ServeRecorder(args.record, run, fps, lock=lock)


def _contract_cameras(parser, checkpoint, args, obs_map: ObservationMap):
    """The checkpoint's deployment contract and the camera slots to serve: the contract's camera keys unless
    --cameras (or --obs_map) names the client's keys, which must be as many, once each; --num_camera_slots must
    agree with it. A contradiction is refused unless --override names it."""
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.serving.contract import ContractError, choose, refuse_repeated_cameras

    contract = resolve_contract(checkpoint, args.revision)
    spec = None
    if contract is not None:
        from hf_vla.evaluation.settings import head_spec

        spec = head_spec(contract, args.head)
    cameras = obs_map.cameras
    refuse_repeated_cameras("--cameras", cameras)
    trained = [c["key"] for c in spec["cameras"]] if spec else None
    if trained and cameras and len(cameras) != len(trained) and "cameras" not in args.override:
        raise ContractError(f"--cameras {' '.join(cameras)}: {len(cameras)} camera(s), but the checkpoint was trained "
                            f"with {len(trained)} ({' '.join(str(k) for k in trained)}); pass --override cameras to "
                            "serve it anyway")
    if trained and not cameras:
        obs_map.cameras = [key for key in trained if key is not None]  # the keys the data had, in slot order
    elif trained and cameras and cameras != trained:
        logger.info("cameras %s fill the checkpoint's slots %s", cameras, trained)
    slots = choose("num_camera_slots", args.num_camera_slots, len(trained) if trained else None, None,
                   set(args.override)).value
    return contract, slots


def cli(argv=None):
    return run("hf_vla.serve", main, argv)


if __name__ == "__main__":
    cli()


__all__ = ["Batcher", "PolicyServer", "RefusedArray", "refused_arrays", "default_max_connections", "default_max_message_mb", "packb", "unpackb", "main"]
