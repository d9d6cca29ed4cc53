"""Build the GPU bundle: one ``.tar.xz`` holding what a machine with only PyTorch,
torchvision and timm lacks to run this app through Flower's Ray simulation.

It is built from the distributions installed in the running environment and holds:

* ``lib/``: Flower (``flwr[simulation]``) with every dependency that torch, torchvision
  and timm do not bring, and ``tomli-w``; Ray pruned to the runtime that a simulation
  uses (:data:`PRUNE`); the binaries without their symbol tables; no bytecode, no
  console scripts, no ``RECORD`` files;
* ``app/``: the app (its packages, ``pyproject.toml``, ``conf/``, ``scripts/``) as
  ``git ls-files`` lists it, read from the working tree;
* ``install.sh``: run on the target machine after unpacking. It checks the interpreter
  (the CPython minor version and platform the bundle was built for: it holds compiled
  extension modules) and the distributions it expects there,
  writes Flower's console scripts (``flwr``, ``flower-superlink``, ...) for that
  interpreter, and makes ``lib/`` and ``app/`` importable, through a ``.pth`` file in
  the interpreter's site-packages or, with ``--env-only``, through ``env.sh``;
* ``bundle.json``: the Python version and platform, what is inside, what is expected.

Left out on purpose (the app imports them only where noted): scikit-learn (the
``digits`` dataset), matplotlib (the experiment reports' figures), dp-accounting (the
privacy account of runs with differential privacy): with SciPy they would not fit.

For a machine with another Python, ``--python-version X.Y`` builds it from the CPython
X.Y wheels (Linux x86_64) of the versions installed here instead (:class:`Wheels`,
cached in ``build/wheels-cpXY``), relying on the target for a distribution it has
(:data:`TARGET_IMAGE`: the lent GPU machines' image, or ``--target-has``) only where
that cannot fail without knowing its version (:func:`resolve_wheels`); the installer
then checks those.

    python scripts/gpu_bundle.py                      # build/fedspc-gpu-bundle-cp311-...
    python scripts/gpu_bundle.py --out /tmp/b.tar.xz --stage /tmp/stage
    python scripts/gpu_bundle.py --python-version 3.12   # ...-cp312-... from wheels

Prints the archive's size; exits non-zero when it exceeds ``--limit-mb`` (40).
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath

from packaging import tags
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
NAME = "fedspc-gpu-bundle"
LIMIT_MB = 40.0

# What the target machine has: these with everything they pull in are not bundled.
PROVIDED = ("torch", "torchvision", "timm")
# What the app needs beyond them (with extras).
BUNDLED = (("flwr", ("simulation",)), ("tomli-w", ()))
# The project's dependencies that the bundle leaves out, with where the app needs them.
LEFT_OUT = {
    "scikit-learn": "the 'digits' dataset (fedspc_app/data/datasets.py)",
    "matplotlib": "the experiment reports' figures (fedspc_app/experiments/plots.py)",
    "dp-accounting": "the privacy account of DP runs (fedspc_app/runs/dp_account.py)",
}
# Console scripts the install writes: Flower starts its processes by these names.
SCRIPTS_FROM = ("flwr", "ray")
SCRIPTS_SKIPPED = {"serve", "tune"}  # Ray's, whose packages are pruned

# Paths (relative to site-packages, '/'-separated) left out of the bundled
# distributions: a prefix ending in '/' drops a folder. A Flower simulation on one
# machine runs Ray's GCS server, raylet, its Python worker, log monitor, autoscaler
# monitor, dashboard head and agent (minimal mode) and runtime-env agent (with its own
# aiohttp); none of these imports the libraries below, the dashboard's web client, the
# Java jars or the cloud providers' node launchers (a run from a bundle without
# ray/widgets or ray/autoscaler/_private/local fails: Ray imports them).
PRUNE = (
    "ray/air/", "ray/data/", "ray/llm/", "ray/rllib/", "ray/serve/", "ray/train/",
    "ray/tune/", "ray/workflow/", "ray/jars/",
    "ray/dashboard/client/",
    "ray/util/dask/", "ray/util/spark/", "ray/util/collective/", "ray/util/joblib/",
    "ray/util/multiprocessing/",
    "ray/autoscaler/_private/aws/", "ray/autoscaler/_private/gcp/",
    "ray/autoscaler/_private/_azure/", "ray/autoscaler/_private/aliyun/",
    "ray/autoscaler/_private/vsphere/", "ray/autoscaler/_private/kuberay/",
    "ray/autoscaler/_private/fake_multi_node/", "ray/autoscaler/_private/spark/",
    "ray/autoscaler/aws/", "ray/autoscaler/gcp/", "ray/autoscaler/azure/",
    "ray/autoscaler/kuberay/", "ray/autoscaler/vsphere/",
    "ray/includes/", "ray/setup-dev.py",
    # Other libraries' self-tests.
    "Crypto/SelfTest/", "sqlalchemy/testing/",
)
PRUNE_PARTS = {"__pycache__", "tests"}  # folders dropped wherever they are
PRUNE_SUFFIXES = (".pyc", ".pyi", ".pxd", ".pyx", ".h", ".c", ".cpp")
PRUNE_DIST_INFO = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "sboms"}

# The app's files: these folders and files of the checkout (git ls-files).
APP_FOLDERS = ("fedspc_app/", "strategies/", "clients/", "conf/", "scripts/")
APP_FILES = ("pyproject.toml", "README.md", "LICENSE")


# ------------------------------------------------------------------ installer
INSTALL_SH = r"""#!/usr/bin/env bash
# Install this bundle (the fedspc app with Flower and Ray) for one Python interpreter
# that has torch, torchvision and timm; no network is used.
#
#   bash install.sh [--python PY] [--env-only] [--skip-check NAME[,NAME...]]
#
#   --python PY    the interpreter (default: $PYTHON, else python3)
#   --env-only     change nothing outside this folder: write env.sh to source, instead
#                  of a .pth file in PY's site-packages and console scripts beside PY
#   --skip-check   do not require these distributions that the bundle relies on PY for
#                  (for a trial on a machine without them: the app needs torch)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
env_only=0
skip=
while [ $# -gt 0 ]; do
    case $1 in
        --python) python=$2; shift 2 ;;
        --env-only) env_only=1; shift ;;
        --skip-check) skip=$skip,$2; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if ! command -v "$python" >/dev/null; then
    echo "install.sh: no interpreter '$python' (pass --python)" >&2
    exit 2
fi
exec "$python" "$here/install.py" "$here" "$env_only" "$skip"
"""

# Standard library only: it runs before anything of the bundle is importable.
INSTALL_PY = r'''"""Install the bundle for the interpreter that runs this (install.sh calls it)."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

here = Path(sys.argv[1]).resolve()
env_only = sys.argv[2] == "1"
skipped = {name.strip().lower() for name in sys.argv[3].split(",") if name.strip()}
manifest = json.loads((here / "bundle.json").read_text())
lib, app, bin_dir = here / "lib", here / "app", here / "bin"

built = (manifest["implementation"], manifest["python"], manifest["platform"])
have = (sys.implementation.name, "%d.%d" % sys.version_info[:2], sysconfig.get_platform())
if have != built:
    sys.exit("error: this bundle holds compiled modules for %s %s on %s; %s is %s %s on %s. "
             "Pass --python a matching interpreter, or build a bundle for it "
             "(python scripts/gpu_bundle.py --python-version X.Y)."
             % (*built, sys.executable, *have))


def top_modules(dist):
    """The top-level modules or packages that a distribution installs."""
    try:
        listed = (dist.read_text("top_level.txt") or "").split()
    except OSError:
        listed = []
    if not listed:
        for entry in dist.files or []:
            top = Path(entry).parts[0]
            if top.endswith((".dist-info", ".data", ".pth")) or top in ("..", "__pycache__"):
                continue
            listed.append(top.split(".")[0])
    return sorted(set(listed))


def meets(version, specifier):
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # the bundle's own copy
        sys.path.insert(0, str(lib))
        from packaging.specifiers import SpecifierSet
    return SpecifierSet(specifier).contains(version, prereleases=True)


# What the bundle relies on the interpreter for: installed, importable, and of a version
# that the bundled distributions accept.
versions = manifest.get("expected-versions", {})
problems = []
for name in manifest["provided"] + manifest["expected"]:
    if name in skipped:
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        problems.append("%s is not installed" % name)
        continue
    modules = top_modules(dist)
    if modules and not any(importlib.util.find_spec(m) for m in modules):
        problems.append("%s %s is installed but %s cannot be imported"
                        % (name, dist.version, " or ".join(modules)))
    elif name in versions and not meets(dist.version, versions[name]):
        problems.append("%s is %s; the bundle needs %s%s"
                        % (name, dist.version, name, versions[name]))
if problems:
    sys.exit("error: the bundle relies on %s for %s (%s), but:\n  %s\n(--skip-check NAME "
             "skips a check, for a trial without them)"
             % (sys.executable, ", ".join(manifest["provided"] + manifest["expected"]),
                manifest.get("expected-from", "see bundle.json"), "\n  ".join(problems)))


def write_scripts(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name, target in manifest["scripts"].items():
        module, _, attr = target.partition(":")
        path = folder / name
        path.write_text("#!%s\nimport sys\nfrom %s import %s\n"
                        "if __name__ == '__main__':\n    sys.argv[0] = %r\n"
                        "    sys.exit(%s())\n"
                        % (sys.executable, module, attr.split(".")[0], name, attr))
        path.chmod(0o755)


write_scripts(bin_dir)
(here / "env.sh").write_text(
    'export PYTHONPATH="%s:%s${PYTHONPATH:+:$PYTHONPATH}"\nexport PATH="%s:$PATH"\n'
    % (lib, app, bin_dir))
env = dict(os.environ)
if env_only:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(lib), str(app),
                                                      env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    done = "to use it, run in each shell: source %s" % (here / "env.sh")
else:
    pth = Path(sysconfig.get_paths()["purelib"]) / "fedspc-gpu-bundle.pth"
    try:
        # The bundle's libraries come before site-packages, the app after it: a
        # checkout on the path (the working directory) takes precedence over it.
        pth.write_text("import sys; sys.path[0:0] = [%r]\n%s\n" % (str(lib), app))
    except OSError as exc:
        sys.exit("error: cannot write %s (%s); run install.sh --env-only" % (pth, exc))
    scripts = Path(sys.executable).parent
    try:
        write_scripts(scripts)
        done = "installed: %s; console scripts in %s: %s" % (
            pth, scripts, " ".join(manifest["scripts"]))
    except OSError:
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
        done = "installed: %s; add %s to PATH for the console scripts" % (pth, bin_dir)

check = ("import flwr, ray, shutil, fedspc_app.launch.superlink as s; "
         "print('flwr', flwr.__version__, '| ray', ray.__version__, '| app', s.APP_DIR); "
         "assert shutil.which(s.console_script('flower-superlink')), "
         "'no flower-superlink beside the interpreter or on PATH'")
if subprocess.run([sys.executable, "-c", check], env=env, cwd=str(here)).returncode:
    sys.exit("error: the bundle does not work with %s (see above)" % sys.executable)
print(done)
'''


# --------------------------------------------------------------- distributions
def dependency_closure(roots, locate=None, environment=None, stop=(),
                       wanted=None) -> dict[str, set[str]]:
    """Canonical names of the distributions ``roots`` need, with the extras asked of
    each (``roots``: ``(name, extras)`` pairs).

    ``locate(name, requirement)`` gives a distribution (default: the installed one;
    ``requirement`` is the one that reached it, ``None`` for a root); environment
    markers are evaluated for ``environment`` (default: the running interpreter). The
    names in ``stop`` are listed but not located or followed. ``wanted``, a dict, gets
    for each name the ``(requirer, Requirement)`` pairs that reached it."""
    locate = locate or (lambda key, requirement: installed_distribution(key))
    seen: dict[str, set[str]] = {}
    stack = [(name, set(extras), None) for name, extras in roots]
    while stack:
        name, extras, requirement = stack.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        if key in stop:
            continue
        dist = locate(key, requirement)
        for line in dist.requires or []:
            req = Requirement(line)
            contexts = [{**(environment or {}), "extra": extra} for extra in (extras or {""})]
            if req.marker and not any(req.marker.evaluate(c) for c in contexts):
                continue
            if wanted is not None:
                wanted.setdefault(canonicalize_name(req.name), []).append((key, req))
            stack.append((req.name, set(req.extras), req))
    return seen


def installed_distribution(name: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        sys.exit(f"error: {name} is not installed in this environment (needed by the bundle)")


def provided_distributions() -> set[str]:
    return set(dependency_closure((name, ()) for name in PROVIDED))


def bundled_distributions() -> list[str]:
    return sorted(set(dependency_closure(BUNDLED)) - provided_distributions())


def pruned(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    if PRUNE_PARTS.intersection(parts[:-1]) or rel.endswith(PRUNE_SUFFIXES):
        return True
    if parts[0].endswith(".dist-info") and len(parts) > 1 and parts[1] in PRUNE_DIST_INFO:
        return True
    return any(rel.startswith(prefix) if prefix.endswith("/") else rel == prefix
               for prefix in PRUNE)


def distribution_files(name: str) -> tuple[metadata.Distribution, list[str]]:
    """The files of an installed distribution inside site-packages (console scripts
    and data outside it are left out), '/'-separated and relative to it."""
    dist = metadata.distribution(name)
    files = []
    for entry in dist.files or []:
        rel = PurePosixPath(*Path(entry).parts).as_posix()
        if rel.startswith(("../", "/")):
            continue
        files.append(rel)
    if not files:
        sys.exit(f"error: {name} has no file list (RECORD); reinstall it with pip")
    return dist, files


def console_scripts(dist: metadata.Distribution) -> dict[str, str]:
    return {ep.name: ep.value for ep in dist.entry_points
            if ep.group == "console_scripts" and ep.name not in SCRIPTS_SKIPPED}


# --------------------------------------------------------------------- staging
def installed_files(names: list[str]):
    """``(name, distribution, folder, files)`` of installed distributions, for
    :func:`stage_libraries`."""
    for name in names:
        dist, files = distribution_files(name)
        yield name, dist, Path(dist.locate_file("")), files


def stage_libraries(lib: Path, entries) -> tuple[dict[str, str], dict[str, str], int]:
    """Copy the kept files of the distributions ``entries`` (``(name, distribution,
    folder, files)``, ``files`` relative to ``folder``) into ``lib``; return their
    versions, the console scripts to write and the bytes pruned."""
    versions, scripts, dropped = {}, {}, 0
    for name, dist, base, files in entries:
        versions[name] = dist.version
        if name in SCRIPTS_FROM:
            scripts.update(console_scripts(dist))
        for rel in files:
            source = base / rel
            if not source.is_file():
                continue
            if pruned(rel):
                dropped += source.stat().st_size
                continue
            target = lib / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return versions, scripts, dropped


def app_files(root: Path = ROOT) -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"error: cannot list the app's files with git in {root}: {exc}")
    return sorted(p for p in listed if p in APP_FILES or p.startswith(APP_FOLDERS))


def stage_app(app: Path, root: Path = ROOT) -> int:
    count = 0
    for rel in app_files(root):
        source = root / rel
        if source.is_file():  # listed but deleted in the working tree: left out
            (app / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, app / rel)
            count += 1
    return count


# ------------------------------------------------------------ wheels for a target
# The lent GPU machines' image ('cuda': CPython 3.12.3 at /opt/torch/.venv/bin/python3,
# with PyTorch): the distributions it holds, as read on a machine running it, and the
# versions read there. A bundle built from wheels (--python-version) relies on one of
# these only where that cannot fail without knowing its version (see
# :func:`resolve_wheels`); ``--target-has`` replaces the list.
_TARGET_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
"""
TARGET_IMAGE = tuple(_TARGET_IMAGE.split())
TARGET_VERSIONS = {
    "numpy": "2.5.2", "torch": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0",
    "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2",
    "transformers": "5.17.0", "accelerate": "1.15.0", "torchmetrics": "1.9.0",
}
# Linux x86_64 wheels for glibc 2.28 and older: PyTorch's own wheels need glibc 2.28,
# so a machine with PyTorch has at least that.
MANYLINUX = tuple([f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)]
                  + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])


def parse_target(entries) -> dict[str, str | None]:
    """``NAME`` or ``NAME==VERSION`` entries as canonical names with their versions."""
    target = {}
    for entry in entries:
        name, _, version = entry.partition("==")
        target[canonicalize_name(name.strip())] = version.strip() or None
    return target


def default_target() -> dict[str, str | None]:
    return {canonicalize_name(name): TARGET_VERSIONS.get(name) for name in TARGET_IMAGE}


def marker_environment(python: str) -> dict[str, str]:
    """Environment markers' values for CPython ``python`` on Linux x86_64."""
    full = python if python.count(".") == 2 else f"{python}.0"
    return {"implementation_name": "cpython", "implementation_version": full,
            "os_name": "posix", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "platform_system": "Linux",
            "python_full_version": full, "python_version": ".".join(full.split(".")[:2]),
            "sys_platform": "linux"}


def wheel_tags(python: str) -> set[tags.Tag]:
    major, minor = (int(part) for part in python.split(".")[:2])
    interpreter = f"cp{major}{minor}"
    return (set(tags.cpython_tags((major, minor), abis=[interpreter], platforms=MANYLINUX))
            | set(tags.compatible_tags((major, minor), interpreter, MANYLINUX)))


def unpack_wheel(wheel: Path, folder: Path) -> tuple[metadata.Distribution, list[str]]:
    """Unpack ``wheel`` into ``folder`` as an installation would lay it out in
    site-packages (``*.data/purelib`` and ``platlib`` moved up; its scripts, headers
    and data left out); return its distribution and files (relative to ``folder``)."""
    files = []
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            parts = PurePosixPath(info.filename).parts
            if info.is_dir() or not parts or ".." in parts or info.filename.startswith("/"):
                continue
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            rel = PurePosixPath(*parts).as_posix()
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
            mode = info.external_attr >> 16 & 0o777
            if mode:
                target.chmod(mode | 0o600)
            files.append(rel)
    info_dirs = {rel.split("/")[0] for rel in files if rel.split("/")[0].endswith(".dist-info")}
    if len(info_dirs) != 1:
        sys.exit(f"error: {wheel.name} holds {len(info_dirs)} .dist-info folders, not one")
    return metadata.PathDistribution(folder / info_dirs.pop()), files


class Wheels:
    """The wheels of the bundled distributions for CPython ``python`` on Linux x86_64:
    taken from ``folder``, downloaded into it from the package index (pip) when missing
    unless ``download`` is false, unpacked under ``scratch``. A distribution installed
    here gets the version installed here (the set the tests run with); another, the
    newest that the requirement which reached it allows."""

    def __init__(self, folder: Path, python: str, scratch: Path, download: bool = True):
        self.folder, self.python, self.scratch, self.download = folder, python, scratch, download
        self.tags = wheel_tags(python)
        self.unpacked: dict[str, tuple[metadata.Distribution, Path, list[str], Path]] = {}

    def find(self, key: str, specifier: SpecifierSet) -> Path | None:
        found = []
        for path in self.folder.glob("*.whl"):
            try:
                name, version, _, wheel_tags_ = parse_wheel_filename(path.name)
            except InvalidWheelFilename:
                continue
            if (name == key and specifier.contains(version, prereleases=True)
                    and wheel_tags_ & self.tags):
                found.append((version, path))
        return max(found)[1] if found else None

    def fetch(self, requirement: str) -> None:
        platforms = [arg for platform in MANYLINUX for arg in ("--platform", platform)]
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--only-binary=:all:", "--python-version", self.python,
                   "--implementation", "cp", *platforms, "-d", str(self.folder), requirement]
        self.folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"error: cannot download a wheel of {requirement} for CPython "
                     f"{self.python} on Linux x86_64 into {self.folder}:\n"
                     f"{done.stderr.strip()[-2000:]}")

    def locate(self, key: str, requirement: Requirement | None) -> metadata.Distribution:
        if key in self.unpacked:
            return self.unpacked[key][0]
        try:
            specifier = SpecifierSet(f"=={metadata.version(key)}")
        except metadata.PackageNotFoundError:
            specifier = requirement.specifier if requirement else SpecifierSet()
        wheel = self.find(key, specifier)
        if wheel is None:
            if not self.download:
                sys.exit(f"error: no wheel of {key}{specifier} for CPython {self.python} "
                         f"in {self.folder} (and downloading is off)")
            self.fetch(f"{key}{specifier}")
            wheel = self.find(key, specifier)
            if wheel is None:
                sys.exit(f"error: pip downloaded no matching wheel of {key}{specifier}")
        dist, files = unpack_wheel(wheel, self.scratch / key)
        self.unpacked[key] = (dist, self.scratch / key, files, wheel)
        return dist

    def entries(self, names):
        """``(name, distribution, folder, files)``, for :func:`stage_libraries`."""
        for name in names:
            dist, folder, files, _ = self.unpacked[name]
            yield name, dist, folder, files


def relied_on(version: str | None, extras: set[str], wanted) -> bool:
    """Whether a distribution that the target has meets what asks for it: with no
    extras, and either its version known and within every requirement or, unknown,
    none of them naming a version."""
    if extras:
        return False
    specifiers = [requirement.specifier for _, requirement in wanted]
    if version is not None:
        return all(spec.contains(version, prereleases=True) for spec in specifiers)
    return not any(str(spec) for spec in specifiers)


def resolve_wheels(roots, wheels: Wheels, target: dict[str, str | None]):
    """The distributions to bundle for ``roots`` from ``wheels`` (sorted canonical
    names), and those it relies on the target for, with the requirements they must
    meet there (``{name: specifier}``). A distribution that the target has is bundled
    all the same, with what it needs, where :func:`relied_on` does not hold (the
    bundle's ``lib/`` comes first on the path, so its version wins)."""
    environment = marker_environment(wheels.python)
    shipped: set[str] = set()
    while True:
        wanted: dict[str, list] = {}
        seen = dependency_closure(roots, wheels.locate, environment, set(target) - shipped,
                                  wanted)
        more = {key for key, extras in seen.items() if key in target and key not in shipped
                and not relied_on(target[key], extras, wanted.get(key, []))}
        if not more:
            break
        shipped |= more
    relied = {}
    for key in seen:
        if key in target and key not in shipped:
            specifiers = SpecifierSet()
            for _, requirement in wanted.get(key, []):
                specifiers &= requirement.specifier
            relied[key] = str(specifiers)
    return sorted(set(seen) - set(relied)), relied


# --------------------------------------------------------------------- staging
def target_tags(python: str | None = None) -> tuple[str, str]:
    """The target's ``major.minor`` (default: this interpreter's) and platform
    (``linux-x86_64``)."""
    if python:
        return ".".join(python.split(".")[:2]), "linux-x86_64"
    return f"{sys.version_info[0]}.{sys.version_info[1]}", sysconfig.get_platform()


def archive_name(python: str | None = None) -> str:
    python, platform = target_tags(python)
    return f"{NAME}-cp{python.replace('.', '')}-{platform.replace('-', '_')}.tar.xz"


def environment_plan() -> dict:
    """What :func:`stage` bundles from this environment."""
    names = bundled_distributions()
    provided = provided_distributions()
    # What the bundled distributions need and the target must bring itself.
    expected = sorted(set(dependency_closure(BUNDLED)) & provided)
    return {"python": None, "entries": installed_files(names), "expected": expected,
            "expected-versions": {}, "expected-from": "torch, torchvision and timm bring them"}


def wheel_plan(python: str, wheels: Wheels, target: dict[str, str | None]) -> dict:
    """What :func:`stage` bundles from ``wheels`` for a target that has ``target``."""
    names, relied = resolve_wheels(BUNDLED, wheels, target)
    return {"python": python, "entries": wheels.entries(names), "expected": sorted(relied),
            "expected-versions": {name: spec for name, spec in relied.items() if spec},
            "expected-from": "the target machine's image is expected to hold them",
            "also-on-target": sorted(set(names) & set(target))}


def stage(top: Path, plan: dict | None = None) -> dict:
    """Lay the bundle out under ``top`` (default: from this environment); return its
    manifest (also written there)."""
    plan = plan or environment_plan()
    python, platform = target_tags(plan["python"])
    versions, scripts, dropped = stage_libraries(top / "lib", plan["entries"])
    app_count = stage_app(top / "app")
    manifest = {
        "python": python,
        "implementation": "cpython" if plan["python"] else sys.implementation.name,
        "platform": platform,
        "built": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "provided": sorted(PROVIDED),
        "expected": plan["expected"],
        "expected-versions": plan["expected-versions"],
        "expected-from": plan["expected-from"],
        "distributions": versions,
        "also-on-target": plan.get("also-on-target", []),
        "scripts": scripts,
        "left-out": LEFT_OUT,
        "pruned-bytes": dropped,
        "app-files": app_count,
    }
    (top / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (top / "install.sh").write_text(INSTALL_SH)
    (top / "install.sh").chmod(0o755)
    (top / "install.py").write_text(INSTALL_PY)
    return manifest


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def strip_binaries(top: Path) -> int:
    """Drop the symbol tables of the staged ELF files (``strip --strip-unneeded``: what
    dynamic linking needs stays); return the bytes saved. Ray's raylet, GCS server and
    ``_raylet.so`` and uvloop's extension carry tens of MB of symbols and debug data."""
    strip = shutil.which("strip")
    if strip is None:
        print("warning: no 'strip' on PATH; the binaries keep their symbols", file=sys.stderr)
        return 0
    saved = 0
    for path in sorted(p for p in top.rglob("*") if p.is_file() and is_elf(p)):
        before = path.stat().st_size
        subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
        saved += before - path.stat().st_size
    return saved


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def archive_order(top: Path) -> list[Path]:
    """Files in the order that compresses best: the ELF files first, Ray's three large
    ones (which share most of their code: gRPC, protobuf, abseil) next to each other,
    then the rest grouped by suffix."""
    files = [p for p in top.rglob("*") if p.is_file() or (p.is_dir() and not any(p.iterdir()))]

    def key(path: Path) -> tuple:
        rel = path.relative_to(top).as_posix()
        elf = path.is_file() and is_elf(path)
        return (not elf, not rel.startswith(("lib/ray/_raylet", "lib/ray/core/src/")),
                path.suffix, rel)

    return sorted(files, key=key)


def write_archive(top: Path, out: Path, preset: int, dict_mb: int) -> None:
    """``top`` as ``<NAME>/...`` in an xz-compressed tar (x86 BCJ filter, then LZMA2
    with a dictionary of ``dict_mb`` MiB: large enough to hold all of Ray's binaries),
    owner root."""
    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    filters = [{"id": lzma.FILTER_X86},
               {"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": dict_mb << 20}]
    with lzma.open(partial, "wb", format=lzma.FORMAT_XZ, filters=filters) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in archive_order(top):
            tar.add(path, arcname=f"{NAME}/{path.relative_to(top).as_posix()}",
                    recursive=False, filter=normalise)
    partial.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the archive (default: build/{archive_name()})")
    parser.add_argument("--limit-mb", type=float, default=LIMIT_MB,
                        help="refuse an archive larger than this many MB (10^6 bytes)")
    parser.add_argument("--stage", type=Path, default=None,
                        help="lay the bundle out in this (new) folder and keep it")
    parser.add_argument("--preset", type=int, default=9, choices=range(10),
                        help="xz (LZMA2) compression preset")
    parser.add_argument("--dict-mb", type=int, default=128,
                        help="LZMA2 dictionary in MiB (compressing takes about 10 times "
                             "as much memory, unpacking about as much)")
    parser.add_argument("--no-strip", action="store_true",
                        help="keep the binaries' symbol tables")
    wheel_mode = parser.add_argument_group(
        "a bundle for another Python, from wheels",
        "the distributions installed here name the versions; their wheels for the "
        "target come from --wheels, downloaded into it when missing")
    wheel_mode.add_argument("--python-version", metavar="X.Y", default=None,
                            help="build for CPython X.Y on Linux x86_64 from wheels "
                                 "instead of from this environment (3.12 for the lent "
                                 "GPU machines)")
    wheel_mode.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                            help="the wheels (default: build/wheels-cpXY, git-ignored)")
    wheel_mode.add_argument("--no-download", action="store_true",
                            help="use only the wheels in DIR (no network)")
    wheel_mode.add_argument("--target-has", nargs="+", metavar="NAME[==VERSION]",
                            default=None,
                            help="the distributions the target has (default: the lent GPU "
                                 "machines' image, TARGET_IMAGE); the bundle relies on "
                                 "one only where it cannot fail without its version")
    args = parser.parse_args(argv)
    if args.python_version and not re.fullmatch(r"3\.\d+(\.\d+)?", args.python_version):
        parser.error(f"--python-version takes 3.Y or 3.Y.Z, not {args.python_version!r}")
    if not args.python_version and (args.wheels or args.no_download or args.target_has):
        parser.error("--wheels, --no-download and --target-has go with --python-version")

    if not sys.platform.startswith("linux"):
        sys.exit(f"error: the bundle is built for Linux; this is {sys.platform}")
    out = (args.out or ROOT / "build" / archive_name(args.python_version)).resolve()
    with tempfile.TemporaryDirectory(prefix="fedspc-bundle-") as scratch:
        top = args.stage.resolve() if args.stage else Path(scratch) / NAME
        if top.exists():
            sys.exit(f"error: {top} exists; --stage takes a new folder")
        started = time.monotonic()
        plan = None
        if args.python_version:
            python = target_tags(args.python_version)[0]
            folder = (args.wheels or ROOT / "build" / f"wheels-cp{python.replace('.', '')}")
            wheels = Wheels(folder.resolve(), args.python_version, Path(scratch) / "wheels",
                            download=not args.no_download)
            target = parse_target(args.target_has) if args.target_has else default_target()
            plan = wheel_plan(args.python_version, wheels, target)
        manifest = stage(top, plan)
        stripped = 0 if args.no_strip else strip_binaries(top)
        staged = tree_size(top)
        write_archive(top, out, args.preset, args.dict_mb)
    size = out.stat().st_size
    print(f"bundle for CPython {manifest['python']} on {manifest['platform']}: "
          f"{len(manifest['distributions'])} distributions, {manifest['app-files']} app files")
    print(f"staged {staged / 1e6:.1f} MB (pruned {manifest['pruned-bytes'] / 1e6:.1f} MB, "
          f"stripped {stripped / 1e6:.1f} MB), "
          f"built in {time.monotonic() - started:.0f} s")
    if manifest["also-on-target"]:
        print("bundled though the target has them (the requirements name versions it "
              f"may not meet): {' '.join(manifest['also-on-target'])}")
    print(f"relied on the target for: {' '.join(manifest['provided'] + manifest['expected'])}")
    print(f"archive {out}: {size / 1e6:.2f} MB ({size} bytes; limit {args.limit_mb:g} MB)")
    if size > args.limit_mb * 1e6:
        print(f"error: the archive is larger than {args.limit_mb:g} MB; prune more "
              f"(PRUNE in {Path(__file__).name}) or raise --limit-mb", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
