#!/bin/bash
# One device call: GPU tests beside compile warm-ups, then timed runs from the warm Triton cache, everything packed
# into $OUT (one tarball, a table digest, the test log) by the end or by a watchdog before the call's limit.
#   TESTS   pytest arguments (files and -k), run with -m gpu -rA -n ${NPROC:-10}, capped at ${TEST_CAP:-240} s
#           ("--per-test 2 --sample-seed K": two cases of every test function, another sample for each K)
#   RUNS    one command per line (flashtile bench ...), each with its own --out under R/: first all at once (with
#           "--rounds 1" where the command takes it: compiles, capped at ${TEST_CAP}), then one at a time (each
#           capped at ${RUN_CAP:-60} s)
#   WATCH   seconds after which whatever is there is packed (default 540; keep it under the call's timeout_s)
# Usage on the device:  TESTS='tests/kernels/test_x.py -k y' RUNS=$'flashtile bench configs ... --out R/a' \
#                       bash bench/gpu_call.sh     (R/ is replaced by the results folder)
set -u
export COLUMNS=220 PYTHONUNBUFFERED=1
anchors=../shared/anchors/install.sh
[ -f scratch/anchors/install.sh ] && anchors=scratch/anchors/install.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f "$anchors" ] && PYTHONPATH=$PYTHONPATH:$(bash "$anchors")
# kept between calls while the machine stays warm (an ignored folder the working tree's copy leaves alone)
export TRITON_CACHE_DIR=$PWD/tcache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/tcache/inductor
W=$PWD/tcache/warm; R=$PWD/tcache/timed; rm -rf "$W" "$R"; mkdir -p "$W" "$R"
L=$OUT/log.txt; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$L"; }
pack() {
  tar czf "$OUT/results.tgz" -C "$PWD/tcache" warm timed 2>/dev/null
  cat "$R"/log_* 2>/dev/null | grep -v "^\s*$" | tail -300 > "$OUT/tables.txt"
}
( sleep "${WATCH:-540}"; pack; echo "watchdog packed" >> "$L" ) > /dev/null 2>&1 &
WD=$!
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a "$L"
mapfile -t cmds < <(printf '%s\n' "${RUNS:-}" | grep -v '^\s*$')
TP=
if [ -n "${TESTS:-}" ]; then
  # eval: TESTS keeps its shell quoting (-k "a or b"); a later -m in it replaces "gpu"
  eval "timeout ${TEST_CAP:-240} python3 -m pytest -m gpu -rA -p no:cacheprovider -n ${NPROC:-10} --timeout 250 \
    $TESTS" > "$OUT/tests.log" 2>&1 &
  TP=$!
fi
i=0
for c in "${cmds[@]}"; do  # warm-ups: compile every kernel the timed runs need, all at once
  i=$((i + 1))
  cw=${c//R\//$W\/}
  sub=$(printf '%s' "${cw#flashtile }" | awk '{print $1, $2}')
  # shellcheck disable=SC2086
  python3 -m flashtile.cli $sub --help 2>/dev/null | grep -q -- "--rounds" && cw="$cw --rounds 1"
  (timeout "${TEST_CAP:-240}" bash -c "python3 -m flashtile.cli ${cw#flashtile }" > "$W/log_$i" 2>&1 &)
done
sleep 5
while pgrep -f "flashtile.cli bench" > /dev/null; do sleep 3; done
el "warm-ups done"
[ -n "$TP" ] && { wait "$TP"; el "tests done"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -12 | tee -a "$L"; }
i=0
for c in "${cmds[@]}"; do
  i=$((i + 1))
  c=${c//R\//$R\/}
  timeout "${RUN_CAP:-60}" bash -c "python3 -m flashtile.cli ${c#flashtile }" > "$R/log_$i" 2>&1
  el "run $i rc=$?: $c"
done
kill "$WD" 2>/dev/null
pack
el "end"
