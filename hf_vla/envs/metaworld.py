"""Meta-World through lerobot's own env wrapper, for recording expert data and closed-loop evaluation.

`MetaWorldEnv(task)` is `lerobot.envs.metaworld.MetaworldEnv` (the camera `corner2` moved and flipped upright,
`agent_pos` = the first 4 observation floats, lerobot's task descriptions, seeded resets), the observation `lerobot-eval`
and lerobot's Meta-World datasets use, under LeRobot dataset keys: `observation.image` (the 480 px render resized to
`image_size`, uint8 HxWx3) and `observation.state` (float32 [4]); `info["task"]` is the task description. Actions are
clipped to [-1, 1]; an episode ends on success or after `max_episode_steps`. `crop=(left, top, right, bottom)` (pixels of
the 480 px render, `WORKSPACE` is the table's working area) cuts the render before it is resized: more of the
`image_size` pixels land on small objects (reach's goal sphere is 12 px across in the render, 2-3 px at 96 px
uncropped, 4-5 px cropped to `WORKSPACE`). `expert_action()` is the benchmark's own
scripted policy (`metaworld.policies`) on the current raw observation, clipped like an action.
`action_mode="absolute_ee"` makes the action the hand's absolute target position, what a position-controlled arm
receives (`hand + 0.01 x delta`, Meta-World's action scale; the gripper value unchanged): the env turns it back into
the delta it commands, and the expert's actions are given as targets, so a recording in that space replays exactly.

Rendering is headless (`MUJOCO_GL=egl` unless set: Mesa software rendering, Debian `libegl1` + `libgl1-mesa-dri`;
`osmesa` with `libosmesa6` works too). `fast_render` (default) turns shadows, reflections and multisampling off before
the first frame: 7-16 ms instead of 55-140 ms a frame, the same scene with harder edges. Recording and evaluation must
use the same setting, and do (both go through this class).

Envs made one after another in a process render alike (`close` frees each render context in its own GL context;
without that the next env's frames came out black). `in_worker(...)` runs an env in its own process
(`hf_vla.envs.worker`) and drives it from this one: the recorder and the evaluator use it, one worker per env, so
several envs step side by side.
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from hf_vla.envs.worker import InWorker
from hf_vla.envs.wrappers import render_to_observation, stepper
from hf_vla.errors import ConfigError

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco is first imported: headless rendering
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

CAMERA, STATE, ACTION = "observation.image", "observation.state", "action"
ROBOT_TYPE = "metaworld"
LOCATIONS = "locations"  # the per-frame column of target_text() a recording carries: a token-objective target
SUBTASK = "subtask"  # the per-frame column of subtask_text(): the expert's stage in words (pi0.5's subtask)
FPS = 80  # lerobot's Meta-World env and datasets
DEFAULT_STEPS = 500  # Meta-World's max_path_length
RENDER = 480  # lerobot's render size
# The working area of the five-task benchmark's tasks in the upright corner2 render: the start hand, objects and goals
# of reach, push, button-press-topdown, drawer-open and door-open over 100 seeds each, and the expert's hand path on 3
# seeds each, project into x 146-390, y 129-312 (through the camera's projection); a 256 px square around it.
WORKSPACE = (144, 96, 400, 352)


_PACKAGES = ("metaworld", "mujoco", "gymnasium", "lerobot")  # what the Meta-World env needs installed


def _lerobot_metaworld():
    try:
        import lerobot.envs.metaworld as module
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in _PACKAGES:
            raise ConfigError(f"Meta-World is not installed ({error}); install it with `pip install -e "
                              "'.[metaworld]'` (metaworld 3.0.0, mujoco 3.3)") from error
        raise _no_renderer(error) from error
    except Exception as error:  # mujoco opens its GL backend when imported
        raise _no_renderer(error) from error
    return module


def _no_renderer(error: BaseException) -> ConfigError:
    backend = os.environ.get("MUJOCO_GL")
    library = {"egl": "libegl1 and libgl1-mesa-dri", "osmesa": "libosmesa6"}.get(backend, "libegl1 and libgl1-mesa-dri")
    return ConfigError(f"Meta-World cannot render headless with MUJOCO_GL={backend} ({type(error).__name__}: "
                       f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}); install Debian's "
                       f"{library} (apt-get install {library.replace(' and ', ' ')}), or set MUJOCO_GL=egl")


GROUPS = ("easy", "medium", "hard", "very_hard")  # lerobot's difficulty groups, the published MT50 breakdown
MT50 = ("mt50", "all")


def task_names(spec: str) -> list[str]:
    """`reach-v3,push-v3`, a difficulty group (`easy`, `medium`, `hard`, `very_hard`), `mt50` / `all` (the 50 tasks,
    group by group) or a mix -> task names. A name may leave out `-v3`."""
    module = _lerobot_metaworld()
    names: list[str] = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        if part.lower() in MT50:
            names += [name for group in GROUPS for name in module.DIFFICULTY_TO_TASKS[group]]
            continue
        if part in module.DIFFICULTY_TO_TASKS:
            names += module.DIFFICULTY_TO_TASKS[part]
            continue
        name = part if part in module.TASK_DESCRIPTIONS else f"{part}-v3"
        if name not in module.TASK_DESCRIPTIONS:
            known = sorted(module.TASK_DESCRIPTIONS)
            raise ConfigError(f"Meta-World task {part!r} is not known; choose from {len(known)} tasks such as "
                              f"{known[:4]}, a group {sorted(module.DIFFICULTY_TO_TASKS)} or mt50")
        names.append(name)
    if not names:
        raise ConfigError(f"no Meta-World task in {spec!r}")
    return list(dict.fromkeys(names))


def task_group(name: str) -> str:
    """The difficulty group of a task (lerobot's grouping)."""
    groups = _lerobot_metaworld().DIFFICULTY_TO_TASKS
    return next(group for group in GROUPS if name in groups[group])


def task_description(name: str) -> str:
    return _lerobot_metaworld().TASK_DESCRIPTIONS[name]


def check_crop(crop) -> tuple[int, int, int, int] | None:
    """`crop` as a (left, top, right, bottom) pixel box inside the 480 px render, or None; a ConfigError names it."""
    if crop is None:
        return None
    try:
        box = tuple(int(v) for v in (crop.split(",") if isinstance(crop, str) else crop))
    except (TypeError, ValueError):
        box = ()
    if len(box) != 4 or not (0 <= box[0] < box[2] <= RENDER and 0 <= box[1] < box[3] <= RENDER):
        raise ConfigError(f"crop={crop!r}: give left,top,right,bottom pixels of the {RENDER} px render with "
                          f"left < right and top < bottom (the workspace is {','.join(map(str, WORKSPACE))})")
    return box


# the cameras of Meta-World's scene; corner2 is the benchmark's (lerobot's) scene camera, gripperPOV looks out of the hand
CAMERAS = ("corner2", "corner", "corner3", "topview", "behindGripper", "gripperPOV")
SCENE_CAMERA = "corner2"


def camera_keys(cameras) -> dict[str, str]:
    """Camera names (a list or `corner2,gripperPOV`) -> their LeRobot keys, in the order given:
    `observation.images.<name>`, or lerobot's `observation.image` for corner2 alone. A ConfigError names an unknown
    or repeated camera."""
    names = [c.strip() for c in (cameras.split(",") if isinstance(cameras, str) else cameras or ()) if c.strip()]
    if not names:
        raise ConfigError(f"cameras={cameras!r}: name at least one of {list(CAMERAS)}")
    unknown = [name for name in names if name not in CAMERAS]
    if unknown:
        raise ConfigError(f"cameras: {unknown} is not a camera of Meta-World's scene; choose from {list(CAMERAS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"cameras={','.join(names)}: a camera is named twice")
    if names == [SCENE_CAMERA]:
        return {SCENE_CAMERA: CAMERA}
    return {name: f"observation.images.{name}" for name in names}


ACTION_MODES = ("delta", "absolute_ee")  # Meta-World's own deltas, or the absolute hand target (position control)
ACTION_SCALE = 0.01  # Meta-World's `action_scale`: a delta of 1 moves the hand's target by 1 cm


def _fast_render(env) -> None:
    model = env.model
    model.light_castshadow[:] = 0
    model.mat_reflectance[:] = 0
    model.vis.quality.offsamples = 0


class MetaWorldEnv(gym.Env):
    """One Meta-World task in lerobot's wrapper, with LeRobot dataset keys and the scripted expert."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": FPS}

    def __init__(self, task: str = "reach-v3", image_size: int = 128, max_episode_steps: int = DEFAULT_STEPS,
                 fast_render: bool = True, render_mode: str = "rgb_array", crop=None, action_mode: str = "delta",
                 cameras=(SCENE_CAMERA,)):
        self.crop = check_crop(crop)
        self.cameras = camera_keys(cameras)
        if action_mode not in ACTION_MODES:
            raise ConfigError(f"action_mode={action_mode!r}: choose one of {list(ACTION_MODES)}")
        self.action_mode = action_mode
        module = _lerobot_metaworld()
        (task,) = task_names(task)
        fast = fast_render

        class Wrapped(module.MetaworldEnv):  # keeps the raw observation the expert reads
            def _ensure_env(self):
                fresh = self._env is None
                super()._ensure_env()
                if fresh and fast:
                    _fast_render(self._env)

            def _format_raw_obs(self, raw_obs):
                self.raw_obs = raw_obs
                return super()._format_raw_obs(raw_obs)

        self.inner = Wrapped(task=task, obs_type="pixels_agent_pos")
        self.task_name, self.task = task, self.inner.task_description
        # gymnasium's wrappers clip the commanded delta to lerobot's action space and end the episode at the limit
        self._stepper = stepper(self.inner, self.task, max_episode_steps)
        self.image_size, self.max_episode_steps, self.render_mode = image_size, max_episode_steps, render_mode
        self.observation_space = spaces.Dict({
            **{key: spaces.Box(0, 255, (image_size, image_size, 3), np.uint8) for key in self.cameras.values()},
            STATE: spaces.Box(-np.inf, np.inf, (4,), np.float32),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32) if action_mode == "delta" else spaces.Box(
            np.array([-np.inf, -np.inf, -np.inf, -1.0], np.float32), np.array([np.inf, np.inf, np.inf, 1.0], np.float32))
        self._image = None

    def _observation(self, raw: dict) -> dict:
        images = {}
        for name, key in self.cameras.items():
            if name == SCENE_CAMERA:  # lerobot's render, upright; the crop is in its pixels
                images[key] = render_to_observation(raw["pixels"], self.crop, self.image_size)
            else:
                images[key] = render_to_observation(self.render_camera(name), None, self.image_size)
        self._image = next(iter(images.values()))
        return {**images, STATE: np.asarray(raw["agent_pos"], dtype=np.float32)}

    def render_camera(self, name: str) -> np.ndarray:
        """The 480 px frame of another camera of the scene, in the process's one GL context (the env's own offscreen
        viewer) with the same render settings. gymnasium's viewer turns MuJoCo's bottom-up pixels upright, so the
        frame's top is the camera's up (for gripperPOV, the hand's: tests/test_metaworld_cameras.py projects the goal
        into every frame of an episode); lerobot turns only corner2's by a further 180 degrees."""
        env = self.inner._env
        viewer = env.mujoco_renderer._get_viewer("rgb_array")
        return viewer.render("rgb_array", camera_id=env.model.camera(name).id).copy()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        try:
            raw, _ = self._stepper.reset(seed=seed)
        except Exception as error:  # the GL context is made at the first render: no GL names the library to install
            if "gl" in f"{type(error).__name__} {error}".lower():
                raise _no_renderer(error) from error
            raise
        return self._observation(raw), {"task": self.task, "is_success": False}

    def step(self, action):
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (4,):
            raise ValueError(f"Meta-World takes 4-dim actions (dx, dy, dz, gripper), got {action.shape[0]}")
        if self.action_mode == "absolute_ee":  # the hand's target position: the delta that moves the hand there
            action = np.concatenate([self.to_delta(action[:3]), action[3:]])
        raw, reward, terminated, truncated, info = self._stepper.step(action)
        return self._observation(raw), reward, terminated, truncated, info

    def render(self):
        return self._image

    # ---- where things are in the image: training targets (pi0.5's object locations), never policy inputs ----------
    def project(self, points) -> np.ndarray:
        """World points `[n, 3]` -> `[n, 2]` pixel (x, y) in this env's observation image (after the crop and the
        resize), through the corner2 camera's pinhole (MuJoCo's `cam_xpos` / `cam_xmat` / `cam_fovy`) and lerobot's
        orientation: gymnasium flips the render upright and lerobot's wrapper then flips both axes, so its image is the
        camera's upright view turned 180 degrees (checked against a segmentation render: tests/test_metaworld.py)."""
        env = self.inner._env
        model, data = env.model, env.data
        cam = model.camera("corner2").id
        points = np.atleast_2d(np.asarray(points, dtype=np.float64))
        local = (points - data.cam_xpos[cam]) @ data.cam_xmat[cam].reshape(3, 3)  # camera frame: looks along -z
        focal = 0.5 * RENDER / np.tan(np.deg2rad(model.cam_fovy[cam]) / 2)
        depth = np.maximum(-local[:, 2], 1e-9)
        upright = np.stack([RENDER / 2 + focal * local[:, 0] / depth, RENDER / 2 - focal * local[:, 1] / depth], 1)
        pixels = RENDER - upright  # turned 180 degrees
        left, top, right, bottom = self.crop or (0, 0, RENDER, RENDER)
        return (pixels - [left, top]) * [self.image_size / (right - left), self.image_size / (bottom - top)]

    def locations(self) -> dict[str, tuple[float, float]]:
        """Pixel (x, y) of the gripper, the task's (first) object and its goal in the current observation image, from
        the raw observation the expert reads (hand xyz, object xyz, goal xyz); those outside the image are left out."""
        raw = np.asarray(self.inner.raw_obs, dtype=np.float64)
        names = ("gripper", "object", "goal")
        pixels = self.project(np.stack([raw[0:3], raw[4:7], raw[-3:]]))
        return {name: (float(x), float(y)) for name, (x, y) in zip(names, pixels)
                if 0 <= x < self.image_size and 0 <= y < self.image_size}

    def body_mask(self, body: str = "hand") -> np.ndarray:
        """`[image_size, image_size]` bool: the pixels of the observation image where a geom of `body` (or of a body
        below it) is seen, from a segmentation render of the same camera through the env's own GL context, oriented,
        cropped and resized (nearest) as the observation is: the check of `project`."""
        import mujoco
        from PIL import Image

        env = self.inner._env
        model = env.model
        viewer = env.mujoco_renderer._get_viewer("rgb_array")
        viewer.cam.type, viewer.cam.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, model.camera("corner2").id
        mujoco.mjv_updateScene(model, env.data, viewer.vopt, viewer.pert, viewer.cam, mujoco.mjtCatBit.mjCAT_ALL,
                               viewer.scn)
        flags = (mujoco.mjtRndFlag.mjRND_SEGMENT, mujoco.mjtRndFlag.mjRND_IDCOLOR)
        for flag in flags:
            viewer.scn.flags[flag] = 1
        try:
            mujoco.mjr_render(viewer.viewport, viewer.scn, viewer.con)
            pixels = np.zeros(3 * viewer.viewport.width * viewer.viewport.height, dtype=np.uint8)
            mujoco.mjr_readPixels(pixels, None, viewer.viewport, viewer.con)
        finally:
            for flag in flags:
                viewer.scn.flags[flag] = 0
        # read bottom-up; gymnasium flips it upright, lerobot's wrapper then flips both axes: net, left-right only
        rgb = pixels.reshape(viewer.viewport.height, viewer.viewport.width, 3)[:, ::-1].astype(np.int64)
        index = rgb[..., 0] + rgb[..., 1] * 256 + rgb[..., 2] * 65536 - 1  # the scene geom drawn there, -1: none
        root = model.body(body).id
        wanted = np.zeros(viewer.scn.ngeom + 1, dtype=bool)
        for i in range(viewer.scn.ngeom):
            geom = viewer.scn.geoms[i]
            if geom.objtype == mujoco.mjtObj.mjOBJ_GEOM:
                owner = model.geom_bodyid[geom.objid]
                while owner not in (0, root):
                    owner = model.body_parentid[owner]
                wanted[i] = owner == root
        mask = np.where(index >= 0, wanted[np.clip(index, 0, viewer.scn.ngeom)], False)
        if self.crop is not None:
            left, top, right, bottom = self.crop
            mask = mask[top:bottom, left:right]
        return np.asarray(Image.fromarray(mask).resize((self.image_size, self.image_size), Image.NEAREST))

    def target_text(self) -> str:
        """The locations as PaliGemma point tokens, `<locY><locX> name` joined by ` ; ` (1024 bins per axis
        against the image's own size): the `locations` column `hf_vla.record` writes."""
        return location_text(self.locations(), self.image_size)

    def subtask_text(self, raw_obs=None) -> str | None:
        """The scripted expert's stage for the current raw observation (or `raw_obs`) in words: the branch of its
        `_desired_pos` that decides the target it moves to (`hf_vla.envs.expert_stages`): the `subtask` column
        `hf_vla.record` writes. An expert without stages (reach's moves straight to the goal) is in one: the task."""
        from hf_vla.envs.expert_stages import expert_stage, stage_text

        raw_obs = self.inner.raw_obs if raw_obs is None else raw_obs
        return stage_text(self.task_name, expert_stage(self.inner.expert_policy, raw_obs)) or self.task

    # ---- the absolute end-effector action space (action_mode="absolute_ee") -----------------------------------------
    def hand(self, raw_obs=None) -> np.ndarray:
        """The hand's xyz in the raw observation (the first three values; lerobot's state holds them too)."""
        return np.asarray(self.inner.raw_obs if raw_obs is None else raw_obs, dtype=np.float64)[:3]

    def to_delta(self, target, raw_obs=None) -> np.ndarray:
        """An absolute hand target -> Meta-World's delta action (`target = hand + ACTION_SCALE x delta`)."""
        return ((np.asarray(target, np.float64) - self.hand(raw_obs)) / ACTION_SCALE).astype(np.float32)

    def to_target(self, delta, raw_obs=None) -> np.ndarray:
        """A delta action -> the absolute hand target it commands (what a position-controlled arm receives)."""
        return (self.hand(raw_obs) + ACTION_SCALE * np.asarray(delta, np.float64)).astype(np.float32)

    def expert_action(self, raw_obs=None) -> np.ndarray:
        """The scripted expert's action for the current raw observation (or `raw_obs`), clipped to the action space;
        with `action_mode="absolute_ee"`, as the hand target it commands (gripper unchanged)."""
        raw_obs = self.inner.raw_obs if raw_obs is None else raw_obs
        action = np.clip(self.inner.expert_policy.get_action(raw_obs), -1.0, 1.0).astype(np.float32)
        if self.action_mode == "absolute_ee":
            action = np.concatenate([self.to_target(action[:3], raw_obs), action[3:]]).astype(np.float32)
        return action

    # the simulator's attributes a step changes besides MuJoCo's state (Meta-World's SawyerXYZEnv.step / _get_obs)
    _STEP_ATTRIBUTES = ("curr_path_length", "_last_stable_obs", "_prev_obs", "_did_see_sim_exception")

    def expert_plan(self, steps: int) -> np.ndarray:
        """`[steps, 4]`: the actions the expert would execute from the current state over the next `steps` steps
        (each as `expert_action` gives it), simulated without rendering on the env's own simulator, whose state
        (MuJoCo's integration state, the step counter, the observation history) is restored after: the env then
        steps exactly as if this had not been called. Past the simulator's step limit the last action repeats. The
        label of a chunked policy's training chunk at a visited state (DAgger with chunks), and the check of how far
        a recording's labels along the visited states are from it (`benchmarks/closed_loop/dagger_labels.py`)."""
        import copy

        import mujoco

        env = self.inner._env
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        saved = np.empty(mujoco.mj_stateSize(env.model, spec))
        mujoco.mj_getState(env.model, env.data, saved, spec)
        attributes = {name: copy.deepcopy(getattr(env, name)) for name in self._STEP_ATTRIBUTES if hasattr(env, name)}
        observation, plan = np.asarray(self.inner.raw_obs), []
        try:
            for _ in range(steps):
                if env.curr_path_length >= env.max_path_length:
                    plan.append(plan[-1] if plan else self.expert_action())
                    continue
                action = self.expert_action(observation)
                plan.append(action)
                delta = action if self.action_mode == "delta" else np.concatenate(
                    [self.to_delta(action[:3], observation), action[3:]])
                observation = env.step(np.clip(delta, -1.0, 1.0))[0]
        finally:
            mujoco.mj_setState(env.model, env.data, saved, spec)
            mujoco.mj_forward(env.model, env.data)
            for name, value in attributes.items():
                setattr(env, name, value)
        return np.stack(plan) if plan else np.zeros((0, 4), np.float32)

    def close(self):
        # mujoco frees a viewer's render context (MjrContext) in whatever GL context is current when the viewer is
        # collected: after gymnasium's close has destroyed the viewer's own, that is the next env's, whose frames
        # then come out black. Freed here, in its own context, a process makes one env after another.
        renderer = getattr(self.inner._env, "mujoco_renderer", None)
        for viewer in getattr(renderer, "_viewers", {}).values():
            viewer.make_context_current()
            viewer.con.free()
        self.inner.close()


def location_text(points: dict[str, tuple[float, float]], size: int) -> str:
    """`{name: (x, y)}` pixel points of a `size` px image -> `<locYYYY><locXXXX> name ; ...` (PaliGemma's point
    form: y first, 1024 bins per axis)."""
    def bin_of(value: float) -> int:
        return int(min(max(np.floor(value / size * 1024), 0), 1023))

    return " ; ".join(f"<loc{bin_of(y):04d}><loc{bin_of(x):04d}> {name}" for name, (x, y) in points.items())


def observation_camera_keys(env_kwargs: dict | None) -> list[str]:
    """The image keys of the observations: those of `env_kwargs`' `cameras` (corner2 by default); every key a camera
    can have without `env_kwargs`."""
    if env_kwargs is None:
        return [CAMERA, *camera_keys(CAMERAS).values()]
    return list(camera_keys(env_kwargs.get("cameras") or ("corner2",)).values())


def group_success(success: dict[str, float]) -> tuple[dict[str, float], dict[str, int]]:
    """Success per difficulty group (the mean over the group's tasks evaluated), and tasks per group."""
    members: dict[str, list[float]] = {}
    for name, rate in success.items():
        members.setdefault(task_group(name), []).append(rate)
    return ({g: float(np.mean(members[g])) for g in GROUPS if g in members},
            {g: len(members[g]) for g in GROUPS if g in members})


def recording_plan(tasks: str | None, image_size: int | None, max_episode_steps: int | None, env_kwargs: dict | None,
                   seed: int):
    """What `hf_vla.record` records: the tasks' envs with their scripted experts, at lerobot's fps and widths; the
    env arguments (crop, action_mode, cameras) checked and kept JSON-able for the plan and marker, the defaults left
    out so that a default recording's marker is as before."""
    from hf_vla.registry import RecordingPlan

    names = task_names(tasks or "reach-v3")
    kwargs = dict(env_kwargs or {})
    unknown = sorted(set(kwargs) - {"crop", "action_mode", "cameras"})
    if unknown:
        raise ConfigError(f"env_kwargs {unknown}: Meta-World recording takes crop, action_mode and cameras "
                          "(image_size and max_episode_steps are arguments of their own)")
    if kwargs.get("cameras") is not None:
        kwargs["cameras"] = list(camera_keys(kwargs["cameras"]))
        if kwargs["cameras"] == ["corner2"]:
            kwargs.pop("cameras")
    if kwargs.get("action_mode", "delta") not in ACTION_MODES:
        raise ConfigError(f"--action_mode {kwargs['action_mode']!r}: choose one of {list(ACTION_MODES)}")
    if kwargs.get("action_mode") == "delta":
        kwargs.pop("action_mode")
    if kwargs.get("crop") is not None:
        kwargs["crop"] = list(check_crop(kwargs["crop"]))
    size = image_size or 128
    make = {name: functools.partial(in_worker, name, image_size=size,
                                    max_episode_steps=max_episode_steps or DEFAULT_STEPS, **kwargs) for name in names}
    return RecordingPlan(names, make, fps=FPS, state_dim=4, action_dim=4, robot_type=ROBOT_TYPE, image_size=size,
                         default_steps=DEFAULT_STEPS, env_kwargs=kwargs)


def in_worker(task: str, **kwargs) -> InWorker:
    """A `MetaWorldEnv` in its own process (`hf_vla.envs.worker`)."""
    return InWorker(functools.partial(MetaWorldEnv, task=task, **kwargs), name=f"Meta-World {task}")


__all__ = ["ACTION", "ACTION_MODES", "ACTION_SCALE", "CAMERA", "FPS", "GROUPS", "InWorker", "MetaWorldEnv", "MT50", "LOCATIONS", "RENDER", "ROBOT_TYPE", "STATE",
           "WORKSPACE", "CAMERAS", "camera_keys", "check_crop", "in_worker", "location_text", "task_description", "task_group", "task_names"]
