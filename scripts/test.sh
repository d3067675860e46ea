#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite as lanes, one pytest process each,
# so the families of tests never share an interpreter (tests/conftest.py says what each holds):
#
#   bash scripts/test.sh                        # every lane: what CI runs (.ci/run)
#   bash scripts/test.sh unit                   # the fast loop: no vLLM, no Ray, no process
#   bash scripts/test.sh engine cluster         # some lanes
#   bash scripts/test.sh cluster -- -k agent -x # pytest arguments after --
#
# Every lane runs even when an earlier one failed; the command fails if any lane failed (or
# ran past its wall limit, KVBLEND_LANE_LIMIT_S, default 2700 s). The unit lane runs on every
# core (pytest-xdist; KVBLEND_TEST_WORKERS to change). A summary names each lane's counts and
# time, and the last line gives the totals ("N passed, N failed, N skipped").
set -uo pipefail
cd "$(dirname "$0")/.."
ALL_LANES=(unit engine cluster integration)

lanes=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; extra=("$@"); break ;;
    unit|engine|cluster|integration) lanes+=("$1"); shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/test.sh: unknown lane '$1' (lanes: ${ALL_LANES[*]}; pytest arguments go after --)" >&2
       exit 2 ;;
  esac
done
[ ${#lanes[@]} -gt 0 ] || lanes=("${ALL_LANES[@]}")

bash scripts/setup.sh || exit 1

limit=${KVBLEND_LANE_LIMIT_S:-2700}
workers=${KVBLEND_TEST_WORKERS:-$(nproc)}
logs=$(mktemp -d "${TMPDIR:-/tmp}/kvblend-lanes-XXXXXX")
trap 'rm -rf "$logs"' EXIT

count() {  # count WORD FILE: the number before WORD on pytest's closing line (0 if none)
  grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)' "$2" | tail -1 \
    | grep -oE "[0-9]+ $1([ ,]|$)" | grep -oE '^[0-9]+' || echo 0
}

declare -A rc_of secs_of
total_start=$SECONDS
for lane in "${lanes[@]}"; do
  args=(-m "$lane" -q -rfEs -p no:cacheprovider --durations=10)
  if [ "$lane" = unit ] && [ "$workers" -gt 1 ]; then
    args+=(-n "$workers")
  fi
  echo
  echo "=== lane $lane: pytest ${args[*]} ${extra[*]}"
  start=$SECONDS
  timeout -k 30 "$limit" .venv/bin/python -m pytest "${args[@]}" "${extra[@]}" 2>&1 | tee "$logs/$lane.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 5 ] && rc=0  # no test selected (e.g. -k matched none in this lane)
  rc_of[$lane]=$rc
  secs_of[$lane]=$((SECONDS - start))
done

echo
echo "=== lanes"
printf '%-12s %-7s %7s %7s %7s %7s %9s\n' lane result passed failed errors skipped time
failed_any=0
tp=0; tf=0; te=0; ts=0
for lane in "${lanes[@]}"; do
  log=$logs/$lane.log
  p=$(count passed "$log"); f=$(count failed "$log"); s=$(count skipped "$log")
  e=$(count 'errors?' "$log")
  rc=${rc_of[$lane]}
  result=ok
  if [ "$rc" != 0 ]; then
    result=FAILED; failed_any=1
    [ $((f + e)) = 0 ] && e=1  # ended without a failure counted (a crash, the wall limit)
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && result="TIMEOUT"
  fi
  t=${secs_of[$lane]}
  printf '%-12s %-7s %7s %7s %7s %7s %6d:%02d\n' "$lane" "$result" "$p" "$f" "$e" "$s" $((t / 60)) $((t % 60))
  tp=$((tp + p)); tf=$((tf + f)); te=$((te + e)); ts=$((ts + s))
done
t=$((SECONDS - total_start))
printf '%-12s %-7s %7s %7s %7s %7s %6d:%02d\n' total "$([ $failed_any = 0 ] && echo ok || echo FAILED)" \
  "$tp" "$tf" "$te" "$ts" $((t / 60)) $((t % 60))
echo "$tp passed, $((tf + te)) failed, $ts skipped"
exit $failed_any
