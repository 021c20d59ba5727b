"""Pack what a bare GPU machine lacks for the GPU benchmarks into one archive that travels with the repository.

    python -m benchmarks.gpu.gpu_site [--output .site/devsite.tar.xz]
    python -m benchmarks.gpu.gpu_site --tests [--output .site/testsite.tar.xz]

A lent GPU machine has PyTorch, accelerate, peft and most of the scientific stack but no network, another transformers
(and a tokenizers that transformers 5.5 refuses), and neither lerobot nor Meta-World. This downloads the wheels of the
versions this project pins (`--no-deps`, for CPython 3.12 on x86-64 Linux), installs them into one folder, compiles
them to bytecode (env worker processes import the stack at once; without bytecode each compiles it again), adds a
stand-in for PyAV (40 MB of bundled FFmpeg; no video is decoded there, but lerobot imports `av` at module level and
checks that it is installed) and packs the folder with xz (about 48 MB, under the 64 MiB a device call carries).

On the GPU machine (`.site` is ignored by git: name it in the call's `carry`):

    mkdir -p /tmp/s && tar xJf .site/devsite.tar.xz -C /tmp/s
    export PYTHONPATH=/tmp/s/devsite:$PWD MUJOCO_GL=egl PYOPENGL_PLATFORM=egl HF_HUB_OFFLINE=1
    python3 -m benchmarks.gpu.rl_gpu --variants lora --updates 5 --progress_dir $OUT --out $OUT/rl_gpu.json

MuJoCo's EGL rendering there also needs the GL loader libraries (libegl1, libglvnd0, libopengl0, libgl1, libglx0,
unpacked with `dpkg -x`), as the device tool's notes describe.

`--tests` packs for the CUDA tests instead (`python3 -m pytest -m gpu`, with the same PYTHONPATH, from
`.site/testsite.tar.xz`): they write small LeRobot video datasets, so the archive holds the real PyAV (40 MB) and,
to stay under the 64 MiB a call carries, no simulator (Meta-World's wheel alone is 37 MB).
"""

from __future__ import annotations

import argparse
import compileall
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What `import hf_vla.rl` and lerobot's Meta-World wrapper need beyond the GPU machine's packages, at this project's
# versions (transformers 5.5 needs tokenizers <= 0.23.0; the machine has 0.23.2).
WHEELS = ["transformers==5.5.4", "tokenizers==0.22.2", "peft==0.21.2", "lerobot==0.6.1", "datasets==4.8.5",
          "dill==0.4.1", "multiprocess==0.70.19", "draccus==0.11.6", "mergedeep==1.3.4", "toml==0.10.2",
          "gymnasium==1.4.0", "farama-notifications==0.0.6", "metaworld==3.0.0", "mujoco==3.3.7",
          "PyOpenGL==3.1.10", "glfw==2.11.0", "pytz==2026.6"]
# left out of --tests' archive; gymnasium stays (lerobot imports it)
SIMULATOR = {"metaworld==3.0.0", "mujoco==3.3.7", "PyOpenGL==3.1.10", "glfw==2.11.0"}
TEST_WHEELS = [w for w in WHEELS if w not in SIMULATOR] + ["av==15.1.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]

AV_STAND_IN = '''"""A stand-in for PyAV on a machine where no video is decoded: lerobot imports `av` at module level and names its
classes in annotations. Every attribute and submodule is a placeholder; calling one raises ImportError."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __getattr__(self, name):
        return _Placeholder()

    def __call__(self, *args, **kwargs):
        raise ImportError("PyAV is not installed on this machine")

    def __or__(self, other):
        return self

    __ror__ = __or__


def __getattr__(name):
    return _Placeholder()


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("av."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = __getattr__
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
'''


def build(output: Path, tests: bool = False) -> Path:
    with tempfile.TemporaryDirectory() as scratch:
        wheels, site = Path(scratch) / "wheels", Path(scratch) / "devsite"
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels),
                        *(TEST_WHEELS if tests else WHEELS)],
                       check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
        if not tests:  # the RL benchmark decodes no video: a stand-in saves 40 MB
            (site / "av").mkdir()
            (site / "av" / "__init__.py").write_text(AV_STAND_IN)
            (site / "av-15.1.0.dist-info").mkdir()
            (site / "av-15.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: av\nVersion: 15.1.0\n")
        # bytecode for the machine's CPython 3.12 (this script must run under 3.12 too: the tag is in the file names)
        if sys.version_info[:2] != (3, 12):
            raise SystemExit(f"run this under Python 3.12 (the GPU machine's), not {sys.version.split()[0]}")
        compileall.compile_dir(str(site), quiet=1, workers=2)
        for tests in site.glob("*/tests"):  # not imported; keeps the archive small
            shutil.rmtree(tests, ignore_errors=True)
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "wb") as handle:
            tar = subprocess.Popen(["tar", "cf", "-", "-C", scratch, "devsite"], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T2", "-6"], stdin=tar.stdout, stdout=handle, check=True)
            tar.wait()
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", action="store_true", help="pack for `pytest -m gpu` (real PyAV, no simulator)")
    parser.add_argument("--output", default=None,
                        help="default: .site/devsite.tar.xz, with --tests .site/testsite.tar.xz")
    args = parser.parse_args(argv)
    output = args.output or REPO / ".site" / ("testsite.tar.xz" if args.tests else "devsite.tar.xz")
    path = build(Path(output), tests=args.tests)
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
