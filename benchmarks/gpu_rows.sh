#!/usr/bin/env bash
# The GPU rows (issue #36) in one call on one GPU: HF Llama-3 8B at fake world 8 (1 x 4096),
# Llama-3 70B at fake world 64 (1 x 1024) and the Mixtral preset at fake world 8 (1 x 4096),
# each one process running fsdp2-compile, mfsdp and mfsdp-cudagraph in bf16, 2 warm-up and
# 5 timed steps; then one table of ratios to fsdp2-compile (fsdp_compile/bench/summary.py).
# Two tensor-parallel rows (issue #39) run only when ROWS names them: 8B at fake world 8 as
# dp 4 x tp 2 (1 x 4096) and 70B at fake world 64 as dp 8 x tp 8 (1 x 1024), every mode
# split by the bench's --tp (their shares would not fit beside the others' in one call).
#
#     bash benchmarks/gpu_rows.sh [OUT]          # OUT: default $OUT when set, else a temp dir
#     bash benchmarks/gpu_rows.sh --smoke [OUT]  # the same rows at tiny presets, on a CPU too
#     ROWS="8b mixtral" bash benchmarks/gpu_rows.sh [OUT]  # only the rows named
#     ROWS="8b-tp 70b-tp" bash benchmarks/gpu_rows.sh [OUT]  # the tensor-parallel rows
#     MODES=fsdp2-compile,mfsdp bash benchmarks/gpu_rows.sh [OUT]  # only the modes named
#     MODES=fsdp2-compile,mfsdp,mfsdp-gather-whole bash benchmarks/gpu_rows.sh [OUT]
#         # the layers gathered member by member, no copy-out (gather_whole_members)
#     LINK=nvlink bash benchmarks/gpu_rows.sh [OUT]  # each collective takes its modeled time,
#         its data copies on a communication stream (the bench's --emulate-link)
#
# Writes OUT/<row>.json (after each mode), OUT/summary.json and the whole log,
# OUT/gpu_rows.log. Needs only python3 ($PYTHON) with torch and transformers.
#
# Time: the device call that runs this is cut at 10 minutes, so every row is bounded: each has
# a share of seconds (below) and may also use what earlier rows left unused, never what later
# rows are guaranteed; all of it, with the summary, is 7 min 20 s at most (5 to 6 expected),
# the two tensor-parallel rows 8 min 40 s at most.
# A row that fails or runs out of time is killed, the next one runs, and the summary names
# the modes that did not finish and why.
set -uo pipefail

smoke=0
if [[ "${1:-}" == "--smoke" ]]; then
    smoke=1
    shift
fi
out="${1:-${OUT:-$(mktemp -d)}}"
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# name preset fake-world tp batch seq share-seconds. The GPU shares come from the H100 runs of
# 2026-11-26 and 27: one-time costs 3-4 s, warm-up 7-11 s for fsdp2-compile and 14-25 s for
# mfsdp (docs/performance.md, "Compile time"), steps of 0.43 s (8B) and 1.3 s (70B), each mode
# built and materialised apart; Python's start, the profiled step's kernel trace and capture on top.
# The tensor-parallel rows' shares are guesses with room: not yet run on a GPU.
# The smoke rows split tiny Llama, whose 2 key-value heads take tp 2 at most.
if ((smoke)); then
    rows=(
        "8b hf-llama-tiny 8 1 1 64 150"
        "70b hf-llama-tiny 64 1 1 64 150"
        "mixtral hf-mixtral-tiny 8 1 1 64 150"
    )
    tp_rows=(
        "8b-tp hf-llama-tiny 8 2 1 64 150"
        "70b-tp hf-llama-tiny 64 2 1 64 150"
    )
else
    rows=(
        "8b hf-llama-8b 8 1 1 4096 125"
        "70b hf-llama-70b 64 1 1 1024 175"
        "mixtral hf-mixtral-2b 8 1 1 4096 95"
    )
    tp_rows=(
        "8b-tp hf-llama-8b 8 2 1 4096 200"
        "70b-tp hf-llama-70b 64 8 1 1024 300"
    )
fi
if [[ -n "${ROWS:-}" ]]; then
    kept=()
    for row in "${rows[@]}" "${tp_rows[@]}"; do
        [[ " $ROWS " == *" ${row%% *} "* ]] && kept+=("$row")
    done
    rows=("${kept[@]}")
fi
# What a killed row may take to exit (timeout's grace before KILL).
grace_s=10

# Seconds the rows after row $1 are guaranteed, with their grace.
later_shares() {
    local total=0 j
    for ((j = $1 + 1; j < ${#rows[@]}; j++)); do
        total=$((total + ${rows[j]##* } + grace_s))
    done
    echo "$total"
}

run_rows() {
    local deadline=$((SECONDS + $(later_shares -1))) statuses=() i
    echo "gpu_rows: $(date -u +%FT%TZ), $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git'), out $out${LINK:+, link $LINK}"
    "$python" -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers", t.__version__)'
    for ((i = 0; i < ${#rows[@]}; i++)); do
        local name preset world tp batch seq share limit status
        read -r name preset world tp batch seq share <<<"${rows[i]}"
        limit=$((deadline - SECONDS - $(later_shares "$i") - grace_s))
        rm -f "$out/$name.json"
        if ((limit < 30)); then
            echo "gpu_rows: $name not started, ${limit} s left of its share"
            statuses+=("$name=not started: the call's time budget was spent")
            continue
        fi
        echo "gpu_rows: $name ($preset, fake world $world, tp $tp, $batch x $seq), at most $limit s"
        timeout --kill-after="$grace_s" "$limit" "$python" -m fsdp_compile.bench \
            --preset "$preset" --fake-world "$world" --tp "$tp" --batch "$batch" --seq "$seq" \
            --param-dtype bfloat16 --modes "${MODES:-fsdp2-compile,mfsdp,mfsdp-cudagraph}" \
            ${LINK:+--emulate-link "$LINK"} --warmup 2 --steps 5 --json "$out/$name.json"
        status=$?
        # On a line of its own: a killed row leaves its progress bar unfinished.
        printf '\ngpu_rows: %s ended with status %s after %s s in all\n' "$name" "$status" "$SECONDS"
        statuses+=("$name=$status")
    done
    "$python" -m fsdp_compile.bench.summary "$out" "${statuses[@]}"
    echo "gpu_rows: $SECONDS s in all; JSON, summary.json and this log in $out"
    for status in "${statuses[@]}"; do
        [[ "${status#*=}" == 0 ]] || return 1
    done
}

run_rows 2>&1 | tee "$out/gpu_rows.log"
exit "${PIPESTATUS[0]}"
