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
  (the same CPython minor version and platform as the one that built the bundle: the
  bundle holds compiled extension modules) and the distributions it expects there,
  writes Flower's console scripts (``flwr``, ``flower-superlink``, ...) for that
  interpreter, and makes ``lib/`` and ``app/`` importable, through a ``.pth`` file in
  the interpreter's site-packages or, with ``--env-only``, through ``env.sh``;
* ``bundle.json``: the Python version and platform, what is inside, what is expected.

Left out on purpose (the app imports them only where noted): scikit-learn (the
``digits`` dataset), matplotlib (the experiment reports' figures), dp-accounting (the
privacy account of runs with differential privacy): with SciPy they would not fit.

    python scripts/gpu_bundle.py                      # build/fedspc-gpu-bundle-cp311-...
    python scripts/gpu_bundle.py --out /tmp/b.tar.xz --stage /tmp/stage

Prints the archive's size; exits non-zero when it exceeds ``--limit-mb`` (40).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
#   bash install.sh [--python PY] [--env-only]
#
#   --python PY   the interpreter (default: $PYTHON, else python3)
#   --env-only    change nothing outside this folder: write env.sh to source, instead
#                 of a .pth file in PY's site-packages and console scripts beside PY
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
env_only=0
while [ $# -gt 0 ]; do
    case $1 in
        --python) python=$2; shift 2 ;;
        --env-only) env_only=1; shift ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
if ! command -v "$python" >/dev/null; then
    echo "install.sh: no interpreter '$python' (pass --python)" >&2
    exit 2
fi
exec "$python" "$here/install.py" "$here" "$env_only"
"""

# Standard library only: it runs before anything of the bundle is importable.
INSTALL_PY = r'''"""Install the bundle for the interpreter that runs this (install.sh calls it)."""
import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

here = Path(sys.argv[1]).resolve()
env_only = sys.argv[2] == "1"
manifest = json.loads((here / "bundle.json").read_text())
lib, app, bin_dir = here / "lib", here / "app", here / "bin"

built = (manifest["implementation"], manifest["python"], manifest["platform"])
have = (sys.implementation.name, "%d.%d" % sys.version_info[:2], sysconfig.get_platform())
if have != built:
    sys.exit("error: this bundle holds compiled modules for %s %s on %s; %s is %s %s on %s. "
             "Pass --python a matching interpreter, or build a bundle with one "
             "(python scripts/gpu_bundle.py)." % (*built, sys.executable, *have))


def installed(name):
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


missing = [name for name in manifest["provided"] + manifest["expected"] if not installed(name)]
if missing:
    sys.exit("error: %s lacks %s, which the bundle expects the environment to have "
             "(torch, torchvision and timm bring them)" % (sys.executable, ", ".join(missing)))


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
def dependency_closure(roots) -> dict[str, set[str]]:
    """Canonical names of the installed distributions ``roots`` need, with the extras
    asked of each (``roots``: ``(name, extras)`` pairs); environment markers are
    evaluated for the running interpreter."""
    seen: dict[str, set[str]] = {}
    stack = [(name, set(extras)) for name, extras in roots]
    while stack:
        name, extras = stack.pop()
        key = canonicalize_name(name)
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            sys.exit(f"error: {key} is not installed in this environment (needed by the bundle)")
        for line in dist.requires or []:
            req = Requirement(line)
            contexts = [{"extra": extra} for extra in (extras or {""})]
            if req.marker and not any(req.marker.evaluate(c) for c in contexts):
                continue
            stack.append((req.name, set(req.extras)))
    return seen


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
def stage_libraries(lib: Path, names: list[str]) -> tuple[dict[str, str], dict[str, str], int]:
    """Copy the bundled distributions' kept files into ``lib``; return their versions,
    the console scripts to write and the bytes pruned."""
    versions, scripts, dropped = {}, {}, 0
    for name in names:
        dist, files = distribution_files(name)
        versions[name] = dist.version
        if name in SCRIPTS_FROM:
            scripts.update(console_scripts(dist))
        base = Path(dist.locate_file(""))
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


def target_tags() -> tuple[str, str]:
    """The interpreter's ``major.minor`` and platform (``linux-x86_64``)."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}", sysconfig.get_platform()


def archive_name() -> str:
    python, platform = target_tags()
    return f"{NAME}-cp{python.replace('.', '')}-{platform.replace('-', '_')}.tar.xz"


def stage(top: Path) -> dict:
    """Lay the bundle out under ``top``; return its manifest (also written there)."""
    python, platform = target_tags()
    names = bundled_distributions()
    versions, scripts, dropped = stage_libraries(top / "lib", names)
    app_count = stage_app(top / "app")
    provided = provided_distributions()
    # What the bundled distributions need and the target must bring itself.
    expected = sorted(set(dependency_closure(BUNDLED)) & provided)
    manifest = {
        "python": python,
        "implementation": sys.implementation.name,
        "platform": platform,
        "built": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "provided": sorted(PROVIDED),
        "expected": expected,
        "distributions": versions,
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
    args = parser.parse_args(argv)

    if not sys.platform.startswith("linux"):
        sys.exit(f"error: the bundle is built for Linux; this is {sys.platform}")
    out = (args.out or ROOT / "build" / archive_name()).resolve()
    with tempfile.TemporaryDirectory(prefix="fedspc-bundle-") as scratch:
        top = args.stage.resolve() if args.stage else Path(scratch) / NAME
        if top.exists():
            sys.exit(f"error: {top} exists; --stage takes a new folder")
        started = time.monotonic()
        manifest = stage(top)
        stripped = 0 if args.no_strip else strip_binaries(top)
        staged = tree_size(top)
        write_archive(top, out, args.preset, args.dict_mb)
    size = out.stat().st_size
    print(f"bundle for CPython {manifest['python']} on {manifest['platform']}: "
          f"{len(manifest['distributions'])} distributions, {manifest['app-files']} app files")
    print(f"staged {staged / 1e6:.1f} MB (pruned {manifest['pruned-bytes'] / 1e6:.1f} MB, "
          f"stripped {stripped / 1e6:.1f} MB), "
          f"built in {time.monotonic() - started:.0f} s")
    print(f"archive {out}: {size / 1e6:.2f} MB ({size} bytes; limit {args.limit_mb:g} MB)")
    if size > args.limit_mb * 1e6:
        print(f"error: the archive is larger than {args.limit_mb:g} MB; prune more "
              f"(PRUNE in {Path(__file__).name}) or raise --limit-mb", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
