"""The websocket server of `python -m hf_vla.serve` and its connections' sessions: openpi's policy protocol, the
per-request checks, recording (`--record`), the connection and message bounds. The module docstring of
`hf_vla.serve` describes the protocol."""

from __future__ import annotations

import dataclasses
import hmac
import http
import logging
import math
import threading
import time
import uuid

import numpy as np

from hf_vla.registry import policy_name
from hf_vla.serving.batcher import Batcher
from hf_vla.serving.codec import packb, refused_arrays, unpackb
from hf_vla.serving.limits import (  # noqa: F401  (importable from here, as before)
    API_KEY_ENV,
    CONNECTION_MEMORY_FACTOR,
    DEFAULT_CAMERA_BYTES,
    DEFAULT_CAMERAS,
    MAX_CONNECTIONS_CAP,
    default_max_connections,
    default_max_message_mb,
)
from hf_vla.serving.policy import Continuation, PolicyRunner, RequestError

logger = logging.getLogger("hf_vla.serve")

RTC_KEYS = ("rtc/inference_delay", "rtc/executed_steps", "rtc/prev_chunk_left_over", "rtc/execution_horizon")
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
                 recorder=None, max_cfg_beta: float = 3.0):
        self.runner = runner
        self.max_cfg_beta = float(max_cfg_beta)  # the largest guidance a request may ask of a RECAP policy
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
            "policy": policy_name(runner.model), "chunk_size": int(config.chunk_size), "action_dims": heads,
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
            "advantage": {"conditioned": bool(getattr(runner.processor, "advantage_conditioned", False)),
                          "cfg_beta": runner.cfg_beta if runner.cfg_beta is not None else getattr(
                              runner.processor, "cfg_beta", 1.0), "max_cfg_beta": self.max_cfg_beta,
                          "indicator": getattr(runner.processor, "advantage_indicator", None)},
            # best-of-N: a request's `best_of` (1 to `max`) overrides `default`
            "best_of": {"default": runner.best_of, "max": runner.max_best_of(), "selector": runner.selector,
                        "critic": getattr(runner.critic, "path", None)},
            # pi0.5's high-level inference: a request's `subtask` (a text, or "auto") overrides `default`
            "subtask": {"layout": getattr(config, "subtask_layout", None), "default": runner.subtask,
                        "every_chunks": runner.subtask_every},
        }

    def _cfg_beta(self, value) -> float | None:
        """A request's `cfg_beta` (guidance of an advantage-conditioned policy, RECAP): a number in
        [0, max_cfg_beta], or None (the checkpoint's)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) or not (
                math.isfinite(float(value)) and 0 <= float(value) <= self.max_cfg_beta):
            raise RequestError(f"cfg_beta={value!r}: a number in [0, {self.max_cfg_beta:g}] (the server's "
                               "--max_cfg_beta); 1 is plain conditioning on 'Advantage: positive'")
        return float(value)

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
        if _optional_bool(request.pop("observe_only", None), "observe_only"):
            # a control step with no chunk asked for: a MEM policy keeps it as the past of the session's next chunks
            if runner.memory is None:
                raise RequestError("observe_only: this policy keeps no past observations (no MEM memory); send "
                                   "observations only to get actions")
            runner.prepare_observation_check(request, head)
            runner.observe(request)
            return {"observed": True}
        delay = _optional_int(request.get("rtc/inference_delay", 0), "rtc/inference_delay")
        cfg_beta = self._cfg_beta(request.get("cfg_beta"))
        best_of = request.get("best_of")  # checked by the runner against its limits.max_best_of
        subtask = request.get("subtask")
        if subtask is not None and (not isinstance(subtask, str) or len(subtask) > runner.limits.max_prompt_chars):
            raise RequestError(f"subtask: a text of at most {runner.limits.max_prompt_chars} characters, or 'auto'")
        start = time.monotonic()
        continuation = Continuation(
            delay, executed_steps=_optional_int(request.get("rtc/executed_steps"), "rtc/executed_steps"),
            prev_chunk_left_over=request.get("rtc/prev_chunk_left_over"),
            execution_horizon=_optional_int(request.get("rtc/execution_horizon"), "rtc/execution_horizon"))
        prepared = runner.prepare(request, head=head, continuation=continuation, cfg_beta=cfg_beta, subtask=subtask,
                                  best_of=best_of)
        intervention = _intervention(request.get("intervention"), runner, prepared.head)
        actions = runner.finish(prepared, self.batcher.submit(prepared))
        elapsed_ms = 1000 * (time.monotonic() - start)
        if not np.isfinite(actions).all():  # never send a robot a NaN action, whatever went wrong upstream
            raise FloatingPointError("the policy produced a non-finite action")
        reply = {"actions": actions.astype(np.float32), "policy_timing": {"infer_ms": elapsed_ms}}
        if runner.last_rtc_method is not None:  # the chunk continued the previous one: "guidance" or "prefix"
            reply["rtc/method"] = runner.last_rtc_method
        if runner.last_selection is not None:  # best-of-N: the chosen candidate and the candidates' spread
            reply |= runner.last_selection.record()
        if runner.last_subtask is not None:  # the subtask this chunk acted on (decoded, or the request's)
            reply["subtask"] = runner.last_subtask
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


__all__ = ["API_KEY_ENV", "CONNECTION_MEMORY_FACTOR", "CONTROL_KEYS", "MAX_CONNECTIONS_CAP", "PolicyServer",
           "default_max_connections", "default_max_message_mb", "quiet_keepalive_failures"]
