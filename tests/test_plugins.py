"""The doors (issue #93): a policy family and an env registered from a module outside hf_vla/ (written here into a
temp dir, as a user's package would be, and named in HF_VLA_PLUGINS) run through `hf_vla.record`, `hf_vla.train`,
`hf_vla.evaluate`, `hf_vla.serve` (openpi's client) and `AutoModel.from_pretrained` with no edit to hf_vla; and no
policy or env name is compared outside the registries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO

PLUGIN = '''
"""A user's package: a pi0.5 variant as its own policy family, and a simulator with tasks and a scripted expert."""
import functools

from transformers import AutoConfig, AutoModel

from hf_vla.envs.reach import ROBOT_TYPE, ColorReachEnv, ColorReachWithExpert
from hf_vla.registry import EnvFamily, RecordingPlan, register_env
from hf_vla.envs.worker import InWorker
from hf_vla.models.pi05.configuration_pi05 import PI05Config
from hf_vla.models.pi05.modeling_pi05 import PI05ForConditionalGeneration
from hf_vla.registry import register_policy, replace
from hf_vla.registry.builtin import PI05


class MyVLAConfig(PI05Config):
    model_type = "my_vla"


class MyVLA(PI05ForConditionalGeneration):
    config_class = MyVLAConfig
    CALLS = 0

    def forward(self, *args, **kwargs):
        MyVLA.CALLS += 1
        return super().forward(*args, **kwargs)


AutoConfig.register("my_vla", MyVLAConfig)
AutoModel.register(MyVLAConfig, MyVLA)
register_policy(replace(PI05, name="my_vla", description="a user's pi0.5 variant", config="my_plugin:MyVLAConfig",
                        model="my_plugin:MyVLA", lerobot_type=None, lerobot_export=False, lerobot_plugin=False))

TASKS = ("corners", "random")  # a task is ColorReach's target layout


def task_names(spec):
    names = list(TASKS) if spec == "all" else [spec]
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ValueError(f"my_reach has no task {unknown}")
    return names


def _env(task, image_size=24, max_episode_steps=12):
    return ColorReachEnv(image_size=image_size, max_steps=max_episode_steps, layout=task)


def in_worker(task, **kwargs):
    return InWorker(functools.partial(_env, task, **kwargs), name=f"my_reach {task}")


def cameras(env_kwargs):
    return ["observation.image"]


def recording(tasks, image_size, max_episode_steps, env_kwargs, seed):
    names = task_names(tasks or "corners")
    size, steps = image_size or 24, max_episode_steps or 12
    make = {name: functools.partial(ColorReachWithExpert, seed, image_size=size, max_steps=steps, layout=name)
            for name in names}
    return RecordingPlan(names, make, fps=10, state_dim=2, action_dim=2, robot_type=ROBOT_TYPE, image_size=size,
                         default_steps=steps, env_kwargs={})


register_env(EnvFamily(name="my_reach", title="MyReach", make="my_plugin:in_worker", tasks="my_plugin:task_names",
                       default_task="corners", cameras="my_plugin:cameras", recording="my_plugin:recording"))
'''


def _run(tmp_path, *args, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env=_env(tmp_path), **kwargs)
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def _env(tmp_path) -> dict:
    path = os.pathsep.join([str(tmp_path / "plugin"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, HF_VLA_PLUGINS="my_plugin", PYTHONPATH=path, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                MUJOCO_GL="egl")


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory):
    """The plugin written as a user's module, its env recorded, its policy trained on the recording (2 steps)."""
    base = tmp_path_factory.mktemp("plugin")
    (base / "plugin").mkdir()
    (base / "plugin" / "my_plugin.py").write_text(PLUGIN)
    _run(base, "-m", "hf_vla.record", "--env", "my_reach", "--task", "corners", "--episodes", "3", "--output",
         str(base / "data"), "--image_size", "24")
    config = json.loads((REPO / "configs" / "demo.json").read_text())
    config["policy"] = "my_vla"
    config["datasets"][0]["root"] = str(base / "data")
    config |= {"output_dir": str(base / "run"), "generate_demo_data": False, "validation_ratio": 0.0, "max_steps": 2,
               "per_device_train_batch_size": 4, "stream_open_blocks": 2, "warmup_steps": 0, "disable_tqdm": True}
    (base / "config.json").write_text(json.dumps(config))
    trained = _run(base, "-m", "hf_vla.train", str(base / "config.json"))
    return base, trained


def test_a_plugin_policy_trains_on_a_plugin_env_and_loads_with_automodel(plugin_run):
    base, trained = plugin_run
    run = base / "run"
    assert json.loads((run / "config.json").read_text())["model_type"] == "my_vla"
    assert f"saved the trained model to {run}" in trained.stdout
    contract = json.loads((run / "deployment_config.json").read_text())
    assert json.dumps(contract).count('"my_reach"') >= 1, contract  # the plugin env is the checkpoint's benchmark
    code = textwrap.dedent(f"""
        import my_plugin, torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(run)!r})
        print(type(model).__name__, model.config.model_type)
    """)
    loaded = _run(base, "-c", code)
    assert loaded.stdout.split() == ["MyVLA", "my_vla"]


def test_a_plugin_policy_is_evaluated_on_its_plugin_env(plugin_run):
    base, _ = plugin_run
    done = _run(base, "-m", "hf_vla.evaluate", "--checkpoint", str(base / "run"), "--episodes", "2",
                "--output_dir", str(base / "eval"))
    result = json.loads((base / "eval" / "eval_result.json").read_text())
    assert result["env"] == "my_reach" and list(result["tasks"]) == ["corners"], done.stdout[-2000:]
    assert result["tasks"]["corners"]["episodes"] == 2


def test_a_plugin_policy_is_served_to_openpis_client(plugin_run):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from hf_vla.envs.reach import ColorReachEnv

    base, _ = plugin_run
    server = subprocess.Popen([sys.executable, "-m", "hf_vla.serve", "--checkpoint", str(base / "run"), "--host",
                               "127.0.0.1", "--port", "0", "--seed", "1"], cwd=base, env=_env(base),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        uri, log, deadline = None, [], time.monotonic() + 180
        while uri is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            log.append(line)
            if "listening on ws://" in line:
                uri = line.strip().rsplit(" ", 1)[-1]
        assert uri, "".join(log)
        client = WebsocketClientPolicy(uri)
        assert client.get_server_metadata()["policy"] == "my_vla"
        env = ColorReachEnv(image_size=24)
        observation, _ = env.reset(seed=3)
        reply = client.infer({**observation, "prompt": env.task})
        assert reply["actions"].shape == (8, 2)
    finally:
        server.terminate()
        server.communicate(timeout=30)


# ---------------------------------------------------------------------------------------------- no name comparisons
POLICY_NAMES = ("pi05", "pi0", "pi05_value")
ENV_NAMES = ("metaworld", "libero", "color_reach")
ALLOWED = {"hf_vla/registry/builtin.py", "hf_vla/registry/envs.py"}  # the registries


def test_no_policy_or_env_name_is_compared_outside_the_registries():
    names = "|".join(POLICY_NAMES + ENV_NAMES)
    quoted = rf"""["']({names})["']"""
    comparison = re.compile(rf"""(==|!=)\s*{quoted}|{quoted}\s*(==|!=)|\bin\s*\(\s*{quoted}|\bin\s*\[\s*{quoted}""")
    found = []
    for path in sorted((REPO / "hf_vla").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if comparison.search(line.split("#", 1)[0]):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_an_unknown_policy_is_one_line_listing_the_registered_ones():
    from hf_vla.errors import ConfigError
    from hf_vla.registry import get_policy

    with pytest.raises(ConfigError, match=r"policy='pi7': not a registered policy; registered: pi05, pi0, pi05_value"):
        get_policy("pi7")


def test_a_plugin_that_does_not_import_is_named(monkeypatch):
    from hf_vla.registry import policies

    monkeypatch.setenv(policies.PLUGINS_ENV, "no_such_plugin_module")
    monkeypatch.setattr(policies, "_plugins_loaded", False)
    from hf_vla.errors import ConfigError

    with pytest.raises(ConfigError, match="HF_VLA_PLUGINS='no_such_plugin_module': module 'no_such_plugin_module' "
                                          "could not be imported"):
        policies.load_plugins()


def test_registering_another_family_under_a_taken_name_is_refused():
    from hf_vla.registry import get_policy, register_policy, replace

    pi05 = get_policy("pi05")
    assert register_policy(pi05) is pi05  # the same family again: nothing changes
    with pytest.raises(ValueError, match="policy 'pi05' is registered already"):
        register_policy(replace(pi05, model="elsewhere:Model"))


def test_the_registries_import_without_torch():
    code = "import sys; sys.argv[:] = ['-m']; import hf_vla.registry as r; r.policy_names(), r.env_names()"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
               if line.startswith("import time:")}
    assert not modules & {"torch", "transformers", "lerobot"}

