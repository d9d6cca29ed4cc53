"""The GPU bundle (``scripts/gpu_bundle.py``): what a machine with only PyTorch,
torchvision and timm lacks to run the app, in one archive under 40 MB.

The slow test builds it, makes a virtual environment that exposes only torch,
torchvision and timm (with what they pull in) from this environment, checks that
Flower and Ray are not importable there, installs the bundle into it without network
and runs a two-client simulation through Flower's Ray engine on the CPU from it.
The fast tests check what goes in and the installer's refusal of another Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bundle.py"
LIMIT = 40e6  # bytes


def load_builder():
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_bundle = load_builder()


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without its virtual environment, PYTHONPATH or Ray address:
    PATH holds only the system folders."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
    env.update(extra)
    return env


def torch_only_venv(folder: Path) -> Path:
    """A virtual environment (no pip) whose site-packages holds links to torch,
    torchvision, timm and the distributions they need, from this environment."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    linked = set()
    for name in sorted(gpu_bundle.provided_distributions()):
        dist, files = gpu_bundle.distribution_files(name)
        base = Path(dist.locate_file(""))
        for rel in files:
            top = PurePosixPath(rel).parts[0]
            if top in linked or top == "__pycache__" or top.endswith(".pth"):
                continue
            linked.add(top)
            (site / top).symlink_to(base / top)
    return python


def run(command: list, *, env: dict, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run([str(part) for part in command], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command[:3]} exited {done.returncode}:\n{output[-4000:]}"
    return output


# ------------------------------------------------------------------ fast checks
def test_the_bundle_leaves_out_what_torch_brings_and_keeps_flower_and_ray():
    bundled = set(gpu_bundle.bundled_distributions())
    provided = gpu_bundle.provided_distributions()
    assert {"flwr", "ray", "grpcio", "tomli-w"} <= bundled
    assert {"torch", "torchvision", "timm", "numpy", "pillow", "pyyaml"} <= provided
    assert not bundled & provided


@pytest.mark.parametrize(("path", "dropped"), [
    ("ray/_raylet.so", False),
    ("ray/core/src/ray/raylet/raylet", False),
    ("ray/core/src/ray/gcs/gcs_server", False),
    ("ray/dashboard/agent.py", False),
    ("ray/widgets/__init__.py", False),
    ("ray/autoscaler/_private/local/node_provider.py", False),
    ("ray/_private/runtime_env/agent/main.py", False),
    ("ray-2.55.1.dist-info/METADATA", False),
    ("ray/serve/__init__.py", True),
    ("ray/dashboard/client/build/index.html", True),
    ("ray/jars/ray_dist.jar", True),
    ("ray/tune/__init__.py", True),
    ("ray/autoscaler/_private/aws/node_provider.py", True),
    ("flwr/__pycache__/__init__.cpython-311.pyc", True),
    ("ray-2.55.1.dist-info/RECORD", True),
])
def test_pruning(path, dropped):
    assert gpu_bundle.pruned(path) is dropped


def test_the_app_files_leave_out_tests_and_docs():
    files = gpu_bundle.app_files()
    assert "pyproject.toml" in files and "fedspc_app/simulate.py" in files
    assert "scripts/gpu_check.sh" in files and "conf/cifar100-resnet34.toml" in files
    assert not [f for f in files if f.startswith(("tests/", "docs/", "deploy/"))]


def test_the_installer_refuses_another_python(tmp_path):
    manifest = {"python": "2.7", "implementation": "cpython", "platform": "linux-x86_64",
                "provided": [], "expected": [], "scripts": {}}
    (tmp_path / "bundle.json").write_text(json.dumps(manifest))
    (tmp_path / "install.sh").write_text(gpu_bundle.INSTALL_SH)
    (tmp_path / "install.py").write_text(gpu_bundle.INSTALL_PY)
    done = subprocess.run(["bash", str(tmp_path / "install.sh"), "--python", sys.executable,
                           "--env-only"], capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "compiled modules for cpython 2.7 on linux-x86_64" in done.stderr
    assert not (tmp_path / "env.sh").exists()


# ------------------------------------------------------------------ the bundle
@pytest.mark.slow
def test_the_bundle_runs_a_simulation_in_a_torch_only_environment(tmp_path):
    if not (sys.platform.startswith("linux") and sysconfig.get_platform() == "linux-x86_64"):
        pytest.skip(f"the bundle is built for Linux x86_64, not {sysconfig.get_platform()}")
    started = time.monotonic()
    archive = tmp_path / "bundle.tar.xz"
    built = run([sys.executable, SCRIPT, "--out", archive], env=dict(os.environ), cwd=ROOT)
    size = archive.stat().st_size
    print(built, f"bundle: {size / 1e6:.2f} MB, built in {time.monotonic() - started:.0f} s")
    assert size < LIMIT

    python = torch_only_venv(tmp_path / "venv")
    env = clean_env()
    probe = ("import importlib.util as u, torch, torchvision, timm; "
             "print([n for n in ('flwr', 'ray', 'grpc', 'fedspc_app') if u.find_spec(n)])")
    assert run([python, "-c", probe], env=env, cwd=tmp_path).strip() == "[]"

    (tmp_path / "opt").mkdir()
    run(["tar", "-xJf", archive, "-C", tmp_path / "opt"], env=env, cwd=tmp_path)
    bundle = tmp_path / "opt" / gpu_bundle.NAME
    installed = run(["bash", bundle / "install.sh", "--python", python], env=env, cwd=tmp_path)
    assert "flwr 1.42" in installed, installed
    assert (python.parent / "flower-superlink").exists()

    work = tmp_path / "work"
    work.mkdir()
    # Ray's socket paths must stay short: its temporary folder goes under /tmp.
    ray_tmp = Path(tempfile.mkdtemp(prefix="fb", dir="/tmp"))
    env = clean_env(RAY_TMPDIR=str(ray_tmp), FEDSPC_CACHE_DIR=str(work / "cache"))
    try:
        imported = ("import fedspc_app, flwr, ray; "
                    "print(fedspc_app.__file__, flwr.__file__, ray.__file__)")
        where = run([python, "-c", imported], env=env, cwd=work)
        assert all(path.startswith(str(bundle)) for path in where.split()), where
        # The digits dataset needs scikit-learn, which the bundle leaves out: the
        # CIFAR-100-shaped random images that scripts/gpu_check.sh uses instead.
        run([python, bundle / "app" / "scripts" / "synthetic_cifar.py", work / "data",
             "--train", "400", "--test", "100"], env=env, cwd=work)
        overrides = (f"dataset='cifar100' data-dir='{work / 'data'}' download=false "
                     "model='cnn' num-rounds=1 local-epochs=1 batch-size=32 device='cpu' "
                     "run-name='bundle'")
        simulated = time.monotonic()
        run([python, "-m", "fedspc_app.simulate", "--clients", "2", "--log", work / "run.log",
             "--set", overrides], env=env, cwd=work)
        print(f"simulation: {time.monotonic() - simulated:.0f} s")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    folder = work / "results" / "bundle"
    assert (folder / "metrics.json").exists() and (folder / "summary.json").exists()
    print(f"bundle {size / 1e6:.2f} MB; test {time.monotonic() - started:.0f} s")
