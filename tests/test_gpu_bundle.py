"""The GPU bundle (``scripts/gpu_bundle.py``): what a machine with only PyTorch,
torchvision and timm lacks to run the app, in one archive under 40 MB.

The slow test builds it, makes a virtual environment that exposes only torch,
torchvision and timm (with what they pull in) from this environment, checks that
Flower and Ray are not importable there, installs the bundle into it without network
and runs a two-client simulation through Flower's Ray engine on the CPU from it.
The fast tests check what goes in and the installer's refusal of another Python.

A bundle for another Python is built from wheels (``--python-version``): fast tests
check the resolution on small wheels made here, and a slow one builds the CPython 3.12
bundle (from the wheels cached in build/wheels-cp312, downloaded there when missing),
installs it into a Python 3.12 virtual environment without torch (``--skip-check``),
starts a local Ray instance with a task and an actor, and runs a numpy-only Flower app
through Flower's Ray simulation engine from it.
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
import zipfile
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


def install_refusal(tmp_path, expected, versions, *skip):
    """The installer's error for a manifest that relies on ``expected``."""
    manifest = {"python": "{}.{}".format(*sys.version_info[:2]), "implementation": "cpython",
                "platform": sysconfig.get_platform(), "provided": [], "expected": expected,
                "expected-versions": versions, "expected-from": "the test says so",
                "scripts": {}}
    (tmp_path / "bundle.json").write_text(json.dumps(manifest))
    (tmp_path / "install.sh").write_text(gpu_bundle.INSTALL_SH)
    (tmp_path / "install.py").write_text(gpu_bundle.INSTALL_PY)
    skips = [arg for name in skip for arg in ("--skip-check", name)]
    done = subprocess.run(["bash", str(tmp_path / "install.sh"), "--python", sys.executable,
                           "--env-only", *skips], capture_output=True, text=True, check=False,
                          cwd=tmp_path)
    return done.stderr if "relies on" in done.stderr else ""


def test_the_installer_names_what_it_relies_on_and_lacks(tmp_path):
    stderr = install_refusal(tmp_path, ["packaging", "fedspc-no-such-dist"],
                             {"packaging": "<1"})
    assert "fedspc-no-such-dist is not installed" in stderr
    assert "the bundle needs packaging<1" in stderr
    assert "the test says so" in stderr
    assert not install_refusal(tmp_path, ["packaging", "fedspc-no-such-dist"],
                               {"packaging": "<1"}, "fedspc-no-such-dist,packaging")


# ------------------------------------------------------------- from wheels
def make_wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any",
               scripts: str = "") -> Path:
    """A small wheel of a package ``name`` (a module, a file under ``*.data/purelib``
    and one under ``*.data/scripts``)."""
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        archive.writestr(f"{stem}.data/purelib/{name.replace('-', '_')}_extra.py", "")
        archive.writestr(f"{stem}.data/scripts/tool", "#!/bin/sh\n")
        archive.writestr(f"{stem}.dist-info/METADATA", meta)
        archive.writestr(f"{stem}.dist-info/RECORD", "")
        if scripts:
            archive.writestr(f"{stem}.dist-info/entry_points.txt",
                             f"[console_scripts]\n{scripts}\n")
    return path


def test_a_wheel_unpacks_as_installed(tmp_path):
    wheel = make_wheel(tmp_path, "fedspc-w", "1.0", ["fedspc-x>=2"], scripts="w = fedspc_w:main")
    dist, files = gpu_bundle.unpack_wheel(wheel, tmp_path / "site")
    assert sorted(files) == ["fedspc_w-1.0.dist-info/METADATA", "fedspc_w-1.0.dist-info/RECORD",
                             "fedspc_w-1.0.dist-info/entry_points.txt",
                             "fedspc_w/__init__.py", "fedspc_w_extra.py"]
    assert dist.version == "1.0" and dist.requires == ["fedspc-x>=2"]
    assert gpu_bundle.console_scripts(dist) == {"w": "fedspc_w:main"}


def test_wheels_for_a_target_python():
    accepted = gpu_bundle.wheel_tags("3.12")
    names = {str(tag) for tag in accepted}
    assert {"cp312-cp312-manylinux_2_17_x86_64", "cp312-abi3-manylinux2014_x86_64",
            "cp39-abi3-manylinux_2_28_x86_64", "py3-none-any"} <= names
    assert not {"cp311-cp311-manylinux_2_17_x86_64", "cp312-cp312-manylinux_2_34_x86_64",
                "cp312-cp312-macosx_11_0_arm64"} & names
    environment = gpu_bundle.marker_environment("3.12")
    flwr_ray = gpu_bundle.Requirement(
        "ray==2.55.1 ; python_full_version >= '3.11' and python_full_version < '3.13' "
        "and extra == 'simulation'")
    assert flwr_ray.marker.evaluate({**environment, "extra": "simulation"})
    assert not flwr_ray.marker.evaluate({**gpu_bundle.marker_environment("3.13"),
                                         "extra": "simulation"})


def test_what_the_target_has_is_relied_on_only_where_its_version_cannot_matter(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    make_wheel(folder, "fedspc-root", "1.0", [
        "fedspc-own>=1", "fedspc-loose", "fedspc-bounded<2", "fedspc-known>=1,<3",
        "fedspc-extra[more]", "fedspc-old ; python_version < '3.12'"])
    make_wheel(folder, "fedspc-own", "1.5", ["fedspc-loose>=0.5"])
    make_wheel(folder, "fedspc-own", "0.5")  # refused: fedspc-own>=1
    make_wheel(folder, "fedspc-bounded", "1.0", ["fedspc-deep"])
    make_wheel(folder, "fedspc-deep", "1.0")
    make_wheel(folder, "fedspc-extra", "1.0")
    make_wheel(folder, "fedspc-loose", "3.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    make_wheel(folder, "fedspc-loose", "2.0", tag="cp312-cp312-manylinux_2_17_x86_64")
    wheels = gpu_bundle.Wheels(folder, "3.12", tmp_path / "scratch", download=False)
    target = gpu_bundle.parse_target(["fedspc-loose", "fedspc-bounded", "fedspc-known==2.1",
                                      "fedspc-extra", "fedspc-deep"])
    shipped, relied = gpu_bundle.resolve_wheels([("fedspc-root", ())], wheels, target)
    # fedspc-loose: the target's, whatever its version, until fedspc-own asks >= 0.5;
    # fedspc-deep, asked for by a bundled one with no version, is the target's.
    assert shipped == ["fedspc-bounded", "fedspc-extra", "fedspc-loose", "fedspc-own",
                       "fedspc-root"]
    assert relied == {"fedspc-deep": "", "fedspc-known": "<3,>=1"}
    versions = {name: wheels.unpacked[name][0].version for name in shipped}
    assert versions["fedspc-own"] == "1.5" and versions["fedspc-loose"] == "2.0"
    with pytest.raises(SystemExit, match="no wheel of fedspc-missing"):
        wheels.locate("fedspc-missing", None)


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


# A Flower app with numpy alone (no torch on the Python 3.12 here): 2 clients, 2 rounds
# through Flower's Ray simulation engine; each client adds 1 to the model.
NUMPY_APP = '''
import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    arrays = [a + 1.0 for a in msg.content["arrays"].to_numpy_ndarrays()]
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "metrics": MetricRecord({"num-examples": 10})})
    return Message(content=content, reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    result = FedAvg(fraction_evaluate=0.0).start(
        grid=grid, initial_arrays=ArrayRecord([np.zeros(3)]), num_rounds=2)
    print("model after 2 rounds:", result.arrays.to_numpy_ndarrays()[0].tolist())


run_simulation(server_app=server, client_app=client, num_supernodes=2,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"num_cpus": 2, "include_dashboard": False}})
'''

RAY_TASKS = '''
import ray
ray.init(num_cpus=2, include_dashboard=False)


@ray.remote
def square(x):
    return x * x


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def add(self):
        self.n += 1
        return self.n


counter = Counter.remote()
print("tasks:", ray.get([square.remote(i) for i in range(4)]),
      "actor:", ray.get([counter.add.remote() for _ in range(3)]))
ray.shutdown()
'''


def python_312() -> Path | None:
    """A CPython 3.12 interpreter: $FEDSPC_PYTHON312, python3.12 on PATH or pyenv's."""
    candidates = [os.environ.get("FEDSPC_PYTHON312"), shutil.which("python3.12"),
                  *sorted(map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python")))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
            return Path(candidate)
    return None


@pytest.mark.slow
def test_the_cp312_bundle_runs_ray_and_a_flower_simulation_on_python_312(tmp_path):
    if sysconfig.get_platform() != "linux-x86_64":
        pytest.skip(f"the bundle is built for Linux x86_64, not {sysconfig.get_platform()}")
    interpreter = python_312()
    if interpreter is None:
        pytest.skip("no CPython 3.12 here (python3.12 on PATH, pyenv's or $FEDSPC_PYTHON312)")
    cache = ROOT / "build" / "wheels-cp312"
    started = time.monotonic()
    archive = tmp_path / "bundle.tar.xz"
    done = subprocess.run([sys.executable, SCRIPT, "--python-version", "3.12", "--wheels",
                           cache, "--out", archive], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    if done.returncode and "cannot download" in done.stderr:
        pytest.skip(f"{cache} lacks wheels and the package index is out of reach")
    assert done.returncode == 0, done.stdout + done.stderr
    size = archive.stat().st_size
    print(done.stdout)
    assert size < LIMIT

    (tmp_path / "opt").mkdir()
    env = clean_env()
    run(["tar", "-xJf", archive, "-C", tmp_path / "opt"], env=env, cwd=tmp_path)
    bundle = tmp_path / "opt" / gpu_bundle.NAME
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["python"] == "3.12"
    assert {"flwr", "ray", "grpcio", "protobuf"} <= set(manifest["distributions"])
    assert "numpy" in manifest["expected"]

    # A Python 3.12 environment with what the bundle relies on but torch, torchvision
    # and timm: their wheels from the same cache.
    subprocess.run([interpreter, "-m", "venv", "--without-pip", tmp_path / "venv"], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    env=env, cwd=tmp_path).strip())
    wheels = gpu_bundle.Wheels(cache, "3.12", tmp_path / "unpacked")
    try:
        for name in manifest["expected"]:
            wheels.locate(name, None)
    except SystemExit as exc:
        pytest.skip(f"no wheel of what the bundle relies on, and no package index: {exc}")
    for _, _, folder, _ in wheels.entries(manifest["expected"]):
        shutil.copytree(folder, site, dirs_exist_ok=True)

    refused = subprocess.run(["bash", bundle / "install.sh", "--python", python], env=env,
                             cwd=tmp_path, capture_output=True, text=True, check=False)
    assert refused.returncode and "torch is not installed" in refused.stderr, refused.stderr
    installed = run(["bash", bundle / "install.sh", "--python", python,
                     "--skip-check", "torch,torchvision,timm"], env=env, cwd=tmp_path)
    assert "flwr 1.42" in installed, installed
    assert (python.parent / "flower-superlink").exists()

    work = tmp_path / "work"
    work.mkdir()
    (work / "ray_tasks.py").write_text(RAY_TASKS)
    (work / "numpy_app.py").write_text(NUMPY_APP)
    ray_tmp = Path(tempfile.mkdtemp(prefix="fb", dir="/tmp"))
    env = clean_env(RAY_TMPDIR=str(ray_tmp))
    try:
        probe = ("import sys, flwr, ray, grpc; "
                 "print(sys.version_info[:2], flwr.__file__, ray.__file__, grpc.__file__)")
        where = run([python, "-c", probe], env=env, cwd=work)
        assert where.startswith("(3, 12)"), where
        assert all(path.startswith(str(bundle)) for path in where.split()[2:]), where
        assert "tasks: [0, 1, 4, 9] actor: [1, 2, 3]" in run([python, "ray_tasks.py"],
                                                              env=env, cwd=work)
        simulated = run([python, "numpy_app.py"], env=env, cwd=work)
        assert "model after 2 rounds: [2.0, 2.0, 2.0]" in simulated, simulated[-3000:]
        run([python.parent / "flower-superlink", "--help"], env=env, cwd=work)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"cp312 bundle {size / 1e6:.2f} MB; test {time.monotonic() - started:.0f} s")
