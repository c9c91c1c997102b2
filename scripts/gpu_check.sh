#!/usr/bin/env bash
# One GPU check (`make gpu-check`): the `-m gpu` tests, then the GPU benchmark, then a summary.
# Needs nothing from the network: it uses the torch and triton already installed (PY, else a
# .venv whose torch sees CUDA, else python3) and builds its tiny models locally. Bounded by
# GPU_CHECK_BUDGET_S (default 480 s) on one GPU. Extra arguments go to pytest.
#
#   scripts/gpu_check.sh                       # everything
#   scripts/gpu_check.sh -k nccl               # a subset of the tests
#   GPU_CHECK_OUT=/tmp/gc scripts/gpu_check.sh # keep the logs and the JUnit XML there
set -uo pipefail # no -e: every stage runs and the summary reports each one

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
started=$SECONDS
budget=${GPU_CHECK_BUDGET_S:-480}
bench_budget=${GPU_CHECK_BENCH_S:-150}
test_budget=$((budget - bench_budget - 30)) # 30 s for the pre-flight and the summary
out=${GPU_CHECK_OUT:-$(mktemp -d -t tandem-gpu-check.XXXXXX)}
mkdir -p "$out"

if [[ -z "${PY:-}" ]]; then # the first Python whose torch sees CUDA
    for candidate in .venv/bin/python python3 ""; do
        PY=${candidate:-python3}
        if [[ -z "$candidate" ]]; then
            [[ -x .venv/bin/python ]] && PY=.venv/bin/python # for the pre-flight's message
        elif command -v "$candidate" >/dev/null &&
            "$candidate" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
            break
        fi
    done
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1
# Without an installed tandem (a GPU image's own Python, no `make setup`), import this checkout
# as `tandem` through a folder of links that mirrors the wheel's layout (benchmarks -> bench).
if ! "$PY" -c 'import tandem' 2>/dev/null; then
    alias_root=$(mktemp -d -t tandem-import.XXXXXX)
    mkdir -p "$alias_root/tandem"
    for entry in __init__.py configs engine kernels models server; do
        ln -sfn "$PWD/$entry" "$alias_root/tandem/$entry"
    done
    ln -sfn "$PWD/benchmarks" "$alias_root/tandem/bench"
    export PYTHONPATH="$alias_root${PYTHONPATH:+:$PYTHONPATH}"
    echo "tandem is not installed for $PY: importing this checkout through $alias_root"
fi
unset TRITON_INTERPRET # real compilation, not the interpreter

echo "== pre-flight ($PY)"
if ! "$PY" - <<'PYEOF'; then
import sys

import pytest  # noqa: F401  (the tests need it)
import torch
import triton

if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: run this on a GPU node (the gpu tests skip on CPU)")
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}; "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
PYEOF
    echo "gpu-check: pre-flight failed (no CUDA device, or torch/triton/pytest missing for $PY)"
    exit 2
fi

# Only the files that hold gpu tests: the rest of the suite may need packages (the HTTP stack)
# that a bare GPU image lacks, and a collection error would stop the run.
mapfile -t files < <(grep -l 'pytest.mark.gpu' tests/test_*.py)
if ((${#files[@]} == 0)); then
    echo "gpu-check: no test file under tests/ is marked gpu"
    exit 2
fi
echo "== gpu tests (${files[*]}; at most ${test_budget} s)"
t0=$SECONDS
timeout -k 15 "$test_budget" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --junitxml "$out/gpu-tests.xml" "${files[@]}" "$@" 2>&1 | tee "$out/gpu-tests.log"
test_rc=$?
test_s=$((SECONDS - t0))

bench=benchmarks/gpu.py # run as python -m tandem.bench.gpu
bench_rc=-1
bench_s=0
if [[ -f "$bench" ]]; then
    echo "== benchmark ($bench; at most ${bench_budget} s)"
    t0=$SECONDS
    # shellcheck disable=SC2086 # GPU_BENCH_ARGS is a list of words
    # --quick and a time budget inside the timeout: the script skips what would not fit.
    timeout -k 15 "$bench_budget" "$PY" -m tandem.bench.gpu ${GPU_BENCH_ARGS:---quick --time-budget $((bench_budget - 20))} 2>&1 | tee "$out/gpu-bench.log"
    bench_rc=$?
    bench_s=$((SECONDS - t0))
fi

echo
echo "== GPU check summary"
"$PY" - "$out/gpu-tests.xml" "$test_rc" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

path, rc = sys.argv[1], int(sys.argv[2])
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    cases = []
counts = {"passed": 0, "failed": 0, "skipped": 0}
graph_counts = {"passed": 0, "failed": 0, "skipped": 0}  # test_gpu.py::test_cuda_graph_*
for case in cases:
    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
    bad = [e for e in case if e.tag in ("failure", "error")]
    skip = case.find("skipped")
    outcome = "failed" if bad else "skipped" if skip is not None else "passed"
    if "cuda_graph" in name:
        graph_counts[outcome] += 1
    if bad:
        counts["failed"] += 1
        first = (bad[0].get("message") or "").strip().splitlines()[:1]
        print(f"  FAILED  {name}: {first[0][:160] if first else ''}")
    elif skip is not None:
        counts["skipped"] += 1
        print(f"  skipped {name}: {(skip.get('message') or '')[:160]}")
    else:
        counts["passed"] += 1
        print(f"  passed  {name}")
status = {0: "ok", 5: "NO TEST RAN", 124: "TIMED OUT", 137: "TIMED OUT"}.get(rc, f"FAILED (exit {rc})")
print(f"gpu tests: {status}: {counts['passed']} passed, {counts['failed']} failed, "
      f"{counts['skipped']} skipped")
print(f"  of which CUDA graphs (capture of every bucket, replay == eager): "
      f"{graph_counts['passed']} passed, {graph_counts['failed']} failed, "
      f"{graph_counts['skipped']} skipped")
PYEOF
echo "gpu tests took ${test_s} s"
if ((bench_rc == -1)); then
    echo "benchmark: not run ($bench does not exist yet)"
elif ((bench_rc == 0)); then
    echo "benchmark: ok (${bench_s} s; output above and in $out/gpu-bench.log)"
elif ((bench_rc == 124 || bench_rc == 137)); then
    echo "benchmark: TIMED OUT after ${bench_budget} s"
else
    echo "benchmark: FAILED (exit $bench_rc)"
fi
total=$((SECONDS - started))
echo "total: ${total} s (budget ${budget} s); logs: $out"

if ((test_rc != 0)) || ((bench_rc > 0)); then
    exit 1
fi
exit 0
