"""An env in a process of its own, driven over a pipe: what the recorder, the evaluator and rollouts step.

MuJoCo-based simulators hold one GL context per process well (a second one in the same process gave broken frames),
and a simulator step is CPU work that runs beside the policy. `EnvWorker` runs one env built by a picklable factory
in a child process and answers `reset`, `step`, `render` and any method or attribute (`call`). Its commands are
asynchronous (`send`, then `receive`), so several workers step at once; `InWorker` wraps one as a plain env.

Workers start from a fork server (`multiprocessing`'s `forkserver`, preloaded with this module): the first worker of a
process pays the import of hf_vla once, later ones start in milliseconds. A worker ignores SIGINT and the preemption
signals (the driving process decides when to stop, and closes its workers); an exception inside the env is raised in
the driving process with its own type; a worker that dies is an `EnvWorkerError` naming its env and exit code.

Why not gymnasium's `AsyncVectorEnv` (which runs envs in worker processes too): it steps every env in lockstep and
resets an env when its episode ends, while the episode loop (`hf_vla.envs.episodes.EpisodeRunner`) steps only the
slots with an action queued (the others wait for a policy call, or are idle once their seeds are done), starts each
slot's next episode from a seed of its own, asks envs for what is not in a step (`call("expert_action")`,
`call("target_text")`, renders for the GIFs), and replaces one crashed worker while the others keep their episodes,
which `AsyncVectorEnv` cannot (a dead worker ends the whole vector env). What this module adds over a `Pipe` is those
four commands, the fork server, the signal handling and the exceptions: about 200 lines.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
from collections.abc import Callable

import gymnasium as gym


class EnvWorkerError(RuntimeError):
    """The worker process died (a crashed simulator) or could not start."""


def _serve(connection, factory: Callable) -> None:
    for number in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", signal.SIGTERM)):
        signal.signal(number, signal.SIG_IGN)
    try:
        from hf_vla.cli import quiet_libraries

        quiet_libraries()  # a fresh interpreter: the driving command's settings do not carry over
        env = factory()
        connection.send(("ok", {"observation_space": env.observation_space, "action_space": env.action_space,
                                "task": getattr(env, "task", None), "metadata": getattr(env, "metadata", {})}))
    except BaseException as error:  # noqa: BLE001  (reported to the driving process, which raises it)
        connection.send(("error", _portable(error)))
        return
    while True:
        try:
            command, payload = connection.recv()
        except (EOFError, OSError):  # the driving process is gone
            break
        try:
            if command == "reset":
                result = env.reset(**payload)
            elif command == "step":
                result = env.step(payload)
            elif command == "call":
                name, args, kwargs = payload
                attribute = getattr(env, name)
                result = attribute(*args, **kwargs) if callable(attribute) else attribute
            elif command == "close":
                env.close()
                connection.send(("ok", None))
                break
            else:
                raise ValueError(f"unknown env worker command {command!r}")
            connection.send(("ok", result))
        except BaseException as error:  # noqa: BLE001
            connection.send(("error", _portable(error)))
    connection.close()


def _portable(error: BaseException) -> BaseException:
    """The exception itself when it pickles (so the driver raises its own type), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload([__name__])
    return _CONTEXT


class EnvWorker:
    """One env built by `factory` (picklable: a module-level function or a `functools.partial` of one) in a child
    process. `send(command, payload)` then `receive()`; `request(...)` does both."""

    def __init__(self, factory: Callable, name: str = "env"):
        self.name = name
        ours, theirs = _context().Pipe()
        self.process = _context().Process(target=_serve, args=(theirs, factory), daemon=True, name=f"hf_vla-{name}")
        self.process.start()
        theirs.close()
        self.connection = ours
        self._ready = None

    def ready(self) -> dict:
        """Wait for the env to be built: its spaces, task and metadata."""
        if self._ready is None:
            self._ready = self.receive()
        return self._ready

    def send(self, command: str, payload=None) -> None:
        self.ready()
        try:
            self.connection.send((command, payload))
        except (BrokenPipeError, OSError) as error:
            raise self._died() from error

    def receive(self):
        try:
            status, value = self.connection.recv()
        except (EOFError, OSError) as error:
            raise self._died() from error
        if status == "error":
            raise value
        return value

    def request(self, command: str, payload=None):
        self.send(command, payload)
        return self.receive()

    def _died(self) -> EnvWorkerError:
        self.process.join(timeout=5)
        return EnvWorkerError(f"the worker process of {self.name} died (exit code {self.process.exitcode})")

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.request("close")
            except Exception:  # noqa: BLE001  (a dead or broken worker: terminated below)
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.connection.close()


class InWorker(gym.Env):
    """An env in its own process, driven like the env itself: `reset`, `step`, `render`, `expert_action`, `task`;
    `step_async` / `step_wait` step several workers at once."""

    def __init__(self, factory: Callable, name: str = "env"):
        self.worker = EnvWorker(factory, name)
        self._spaces = None

    def _ready(self) -> dict:
        return self.worker.ready()

    @property
    def observation_space(self):
        return self._ready()["observation_space"]

    @property
    def action_space(self):
        return self._ready()["action_space"]

    @property
    def task(self):
        return self._ready()["task"]

    @property
    def metadata(self):
        return self._ready()["metadata"]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self.worker.request("reset", {"seed": seed, "options": options})

    def step(self, action):
        self.step_async(action)
        return self.step_wait()

    def step_async(self, action) -> None:
        self.worker.send("step", action)

    def step_wait(self):
        return self.worker.receive()

    def render(self):
        return self.worker.request("call", ("render", (), {}))

    def call(self, name: str, *args, **kwargs):
        return self.worker.request("call", (name, args, kwargs))

    def expert_action(self):
        return self.call("expert_action")

    def expert_plan(self, steps: int):
        return self.call("expert_plan", steps)

    def close(self):
        self.worker.close()


def make_gym(env_id: str, **kwargs) -> gym.Env:
    """`gym.make(env_id, **kwargs)` with hf_vla's envs registered (the factory of a gymnasium id in a worker)."""
    import hf_vla.envs  # noqa: F401  (registers hf_vla/ColorReach-v0)

    return gym.make(env_id, **kwargs)


__all__ = ["EnvWorker", "EnvWorkerError", "InWorker", "make_gym"]
