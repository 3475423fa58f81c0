# Sourced by the benchmark scripts: waiting for a process they started.

# wait_addr LOG: the address of the first `listening on <addr>` line in LOG
# (compactor and the examples print one when they are ready), waiting up to
# 30 s for it; the log goes to stderr and the script exits if it never comes.
wait_addr() {
  for _ in $(seq 1 300); do
    if grep -q "listening on" "$1"; then
      grep -o "listening on [0-9.:]*" "$1" | head -1 | awk '{print $3}'
      return
    fi
    sleep 0.1
  done
  echo "process did not start: $1" >&2; cat "$1" >&2; exit 1
}
