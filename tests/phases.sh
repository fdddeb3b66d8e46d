# Steps of a long script run each under a time limit, a failure recorded
# instead of ending the script (sourced by tests/gpu.sh and bench/gpu_run.sh):
#
#   source tests/phases.sh
#   phase NAME LIMIT_S COMMAND [ARGS...]   # prints NAME, its limit and its wall time
#   phases_end                             # names the failed phases; status 1 if any
#
# A phase is its command under `timeout` (SIGTERM at the limit, SIGKILL 10 s
# later). The limit shrinks to what is left before PHASES_DEADLINE (a value
# of $SECONDS) when that is set; with no time left the phase is skipped and
# counts as failed. `timeout` signals its own process group, so a phase's
# children (benchmark ranks, test processes) end with it; a script whose
# phases run inside another script's phase (PHASES_NESTED=1) keeps to that
# group (timeout --foreground), or an outer limit would miss the inner
# phase's processes.
phases_failed=()

phase() {
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  if [[ -n "${PHASES_DEADLINE:-}" ]] && (( PHASES_DEADLINE - SECONDS < limit )); then
    limit=$((PHASES_DEADLINE - SECONDS))
  fi
  if (( limit <= 0 )); then
    echo "=== $name: SKIPPED, no time left"
    phases_failed+=("$name (skipped)")
    return 0
  fi
  local fg=()
  if [[ "${PHASES_NESTED:-0}" == 1 ]]; then
    fg=(--foreground)
  fi
  echo "=== $name (limit ${limit} s)"
  timeout "${fg[@]}" -k 10 "$limit" "$@" || rc=$?
  if (( rc == 0 )); then
    echo "=== $name: ok, $((SECONDS - start)) s"
  elif (( rc == 124 || rc == 137 )); then
    echo "=== $name: TIMED OUT after $((SECONDS - start)) s"
    phases_failed+=("$name (timed out)")
  else
    echo "=== $name: FAILED (exit $rc), $((SECONDS - start)) s"
    phases_failed+=("$name")
  fi
}

phases_end() {
  if (( ${#phases_failed[@]} )); then
    printf '=== failed: %s\n' "${phases_failed[@]}"
    return 1
  fi
  echo "=== all phases passed"
}
