#!/usr/bin/env bash
# Load benchmark: what compactor adds over talking to the upstream directly,
# next to what the cheapest possible proxy hop and nginx add on the same
# machine.
#
#   scripts/bench_load.sh                      # shared layout, 5 s per run
#   LAYOUT=pinned scripts/bench_load.sh        # wrk+mock on CPU 0, proxy on CPU 1
#   LAYOUT=both DUR=8 scripts/bench_load.sh
#   UPSTREAM_DELAY_MS=2 scripts/bench_load.sh  # upstream think time
#   MODES="json sse" scripts/bench_load.sh     # a subset of the request kinds
#   REPS=3 scripts/bench_load.sh               # median of 3 runs per figure (targets in turn)
#   ACCESS_LOG=1 scripts/bench_load.sh         # nginx writes an access log, as compactor
#                                              # writes its request log (both defaults)
#
# Builds with --profile perf, starts the fast mock upstream
# (examples/mock_upstream.rs), the naive proxy (examples/naive_proxy.rs:
# hyper server + pooled client and nothing else, the yardstick for the price
# of one hop), the raw hop (examples/raw_hop.rs: the same tokio threads
# with no HTTP library, finding where messages end and copying bytes: the
# floor of a tokio proxy), nginx (1 worker, proxy_buffering and proxy_request_buffering
# off, upstream keep-alive: the
# reverse proxy an operator already runs; installed from the distribution's
# packages when missing) and compactor, all on loopback. For each target wrk reports
# p50/p99 at concurrency 1 and requests/s at concurrency 64, for
# non-streaming (json; json_big: a long chat of 61 messages, 20 KB;
# json_agent: a 12 KB system prompt and 40 messages, 25 KB),
# streaming (sse: 22 events written back to back) and paced streaming
# (sse_paced: 1 ms between events, like a fast model) requests; the proxies'
# CPU per request (utime+stime / requests) is read from /proc/PID/stat (for
# nginx, its worker's). A summary then sets compactor against nginx (the
# issue 25 targets), and splits their CPU on small JSON at c=64 into user and
# system time, with the threads' voluntary context switches (compactor's
# also on a passthrough route, /v1/embeddings: its hop without the chat
# work), and counts their syscalls per request (perf stat, when perf is
# installed): the system side is the sockets' syscalls, the user side each
# proxy's own work. Then time to first SSE byte (examples/ttfb.rs).
#
# Layouts:
#   shared  everything shares both cores (what a laptop does; a proxy hop
#           then also takes CPU away from the load generator and the mock).
#   pinned  wrk and the mock on CPU 0, the proxy under test alone on CPU 1:
#           the direct run gets the same CPU 0, so the ratio says whether
#           the proxy is the bottleneck.
set -euo pipefail
cd "$(dirname "$0")/.."

DUR="${DUR:-5}"
if [ "$DUR" -gt 10 ]; then DUR=10; fi
DELAY="${UPSTREAM_DELAY_MS:-0}"
TTFB_N="${TTFB_N:-200}"
LAYOUT="${LAYOUT:-shared}"
OUT="${OUT:-target/bench_load}"
mkdir -p "$OUT"

command -v wrk >/dev/null || apt-get install -y wrk >/dev/null
. scripts/bench_nginx.sh
if [ "$LAYOUT" != shared ] && [ "$(nproc)" -lt 2 ]; then
  echo "LAYOUT=$LAYOUT needs 2 CPUs" >&2; exit 1
fi

# NO_BUILD=1: use the binaries already in BIN (default target/perf).
[ -n "${NO_BUILD:-}" ] || cargo build --profile perf --bin compactor --example mock_upstream --example ttfb --example naive_proxy --example raw_hop
BIN="${BIN:-target/perf}"
COMPACTOR_BIN="${COMPACTOR_BIN:-$BIN/compactor}"

PIDS=()
# The binary's default store is a file under the state directory: one
# shared with other runs holds their records, and looking them up would be
# part of what is measured. Each run starts from an empty one.
STATE=$(mktemp -d)
export XDG_STATE_HOME="$STATE"

cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT

# start VAR LOG CPUS CMD...: starts CMD on CPUS (or anywhere if empty) in
# the background, waits for its `listening on <addr>` line, sets VAR to the
# address and VAR_PID to its pid.
start() {
  local var="$1" log="$2" cpus="$3"; shift 3
  if [ -n "$cpus" ]; then
    taskset -c "$cpus" "$@" >"$log" 2>&1 &
  else
    "$@" >"$log" 2>&1 &
  fi
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 100); do
    if grep -q "listening on" "$log"; then
      printf -v "$var" '%s' "$(grep -o "listening on [0-9.:]*" "$log" | head -1 | awk '{print $3}')"
      printf -v "${var}_PID" '%s' "$pid"
      return
    fi
    sleep 0.1
  done
  echo "process did not start: $log" >&2; cat "$log" >&2; exit 1
}

# start_nginx LOG CPUS: nginx as a reverse proxy to $MOCK (1 worker, no
# response buffering, a keep-alive upstream pool, no access log unless
# ACCESS_LOG is set); sets NGINX
# to its address and NGINX_PID to its worker's pid.
start_nginx() {
  local dir="$OUT/nginx" port cpus="$2"
  port=$(free_port)
  NGINX_ACCESS_LOG="${ACCESS_LOG:+$PWD/$dir/access.log}" write_nginx_conf "$dir" "$MOCK" "127.0.0.1:$port" "$PWD/$1"
  if [ -n "$cpus" ]; then
    taskset -c "$cpus" "$NGINX" -c "$PWD/$dir/nginx.conf" -p "$PWD/$dir" >"$1.out" 2>&1 &
  else
    "$NGINX" -c "$PWD/$dir/nginx.conf" -p "$PWD/$dir" >"$1.out" 2>&1 &
  fi
  local master=$!
  PIDS+=("$master")
  NGINX_ADDR="127.0.0.1:$port"
  for _ in $(seq 1 100); do
    NGINX_PID=$(pgrep -P "$master" | head -1 || true)
    if [ -n "$NGINX_PID" ] && curl -s -o /dev/null "http://$NGINX_ADDR/json"; then
      return
    fi
    sleep 0.1
  done
  echo "nginx did not start" >&2; cat "$1" "$1.out" >&2; exit 1
}

# Request bodies as wrk scripts: $OUT/{json,json_big,json_agent,sse}.lua
. scripts/bench_bodies.sh
write_bodies "$OUT"

# wrk latency value (e.g. 45.00us, 1.20ms) → microseconds.
to_us() { awk -v v="$1" 'BEGIN{ n=v+0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n*1000; else if (v ~ /s$/) print n*1000000; else print n }'; }

# CPU time (user+system) of a process in microseconds.
cpu_us() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.0f", ($14 + $15) * 1e6 / hz }' "/proc/$1/stat"; }

# cpu_split PID → "user_us system_us switches": a process's CPU time, user
# and system apart, and its threads' voluntary context switches (a thread
# that found nothing to do and slept).
cpu_split() {
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%.0f %.0f", $14 * 1e6 / hz, $15 * 1e6 / hz }' "/proc/$1/stat"
  awk '/^voluntary_ctxt_switches/ { s += $2 } END { printf " %d\n", s }' /proc/"$1"/task/*/status
}

# json64 TARGET SECONDS FILE [PATH]: small JSON at c=64 for SECONDS (to PATH,
# default the chat route), wrk's report in FILE; prints the requests it
# completed.
json64() {
  $LOADGEN wrk -t2 -c64 -d"$2s" -s "$OUT/json.lua" "http://$1${4:-/v1/chat/completions}" >"$3"
  awk '/requests in/{print $1}' "$3"
}

# split TARGET PID LABEL [PATH]: where a proxy's CPU goes at c=64 on small
# JSON: user and system time and voluntary context switches per request (the
# system side is the sockets' syscalls, the same for every proxy hop; the
# user side is the proxy's own work). PATH (default the chat route) lets
# compactor forward the same body on a passthrough route: its hop without
# the chat work.
split() {
  local target="$1" pid="$2" label="$3" path="${4:-}" u0 s0 v0 u1 s1 v1 n
  read -r u0 s0 v0 < <(cpu_split "$pid")
  n=$(json64 "$target" "$DUR" "$OUT/wrk_split_${LAYOUT_NOW}_${label// /_}.txt" "$path")
  read -r u1 s1 v1 < <(cpu_split "$pid")
  awk -v l="$label" -v n="$n" -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v v=$((v1 - v0)) 'BEGIN {
    printf "  %-16s user %5.1f µs   system %5.1f µs   total %5.1f µs   voluntary context switches %.2f\n", l, u / n, s / n, (u + s) / n, v / n }'
}

# syscalls TARGET PID LABEL: a proxy's syscalls per request at c=64 on small
# JSON, counted by perf's raw_syscalls tracepoint (counting, not tracing) in
# a run of its own so the count's cost stays out of split's times.
syscalls() {
  local target="$1" pid="$2" label="$3" n count perf_pid
  local p="$OUT/perf_syscalls_${LAYOUT_NOW}_${label}.txt"
  if ! command -v perf >/dev/null; then
    echo "  $label syscalls: perf not installed (Debian: linux-perf)"
    return
  fi
  perf stat -x, -e raw_syscalls:sys_enter -p "$pid" -o "$p" 2>/dev/null &
  perf_pid=$!
  sleep 0.2
  n=$(json64 "$target" 3 "$OUT/wrk_syscalls_${LAYOUT_NOW}_${label}.txt")
  kill -INT "$perf_pid" 2>/dev/null || true
  wait "$perf_pid" 2>/dev/null || true
  count=$(awk -F, '/raw_syscalls:sys_enter/ && $1 ~ /^[0-9]+$/ {print $1}' "$p" 2>/dev/null)
  if [ -z "$count" ]; then
    echo "  $label syscalls: not counted (perf stat could not read the tracepoint: root or perf_event_paranoid)"
    return
  fi
  awk -v l="$label" -v n="$n" -v c="$count" 'BEGIN { printf "  %-16s syscalls %.2f a request\n", l, c / n }'
}

# run TARGET PID MODE CONNS → prints "p50_us p99_us rps cpu_us_per_request"
# (cpu is 0 for the direct run: PID is empty).
run() {
  local target="$1" pid="$2" mode="$3" conns="$4"
  local threads=1; [ "$conns" -gt 1 ] && threads=2
  local url="http://$target/v1/chat/completions" script="$mode"
  if [ "$mode" = sse_paced ]; then url="$url?gap_ms=1"; script=sse; fi
  local f="$OUT/wrk_${LAYOUT_NOW}_${target//[:.]/_}_${mode}_c${conns}.txt"
  local before=0 after=0
  [ -n "$pid" ] && before=$(cpu_us "$pid")
  $LOADGEN wrk -t"$threads" -c"$conns" -d"${DUR}s" --latency -s "$OUT/$script.lua" "$url" >"$f"
  [ -n "$pid" ] && after=$(cpu_us "$pid")
  if grep -q "Non-2xx" "$f"; then echo "non-2xx responses in $f" >&2; exit 1; fi
  local p50 p99 rps n
  p50=$(to_us "$(awk '$1=="50%"{print $2}' "$f")")
  p99=$(to_us "$(awk '$1=="99%"{print $2}' "$f")")
  rps=$(awk '/Requests\/sec/{print $2}' "$f")
  n=$(awk '/requests in/{print $1}' "$f")
  echo "$p50 $p99 $rps $(awk -v d=$((after - before)) -v n="$n" 'BEGIN{printf "%.1f", (n > 0 ? d / n : 0)}')"
}

# issue_table FILE: the table of issue 25 from the per-mode figures run()
# gathered (one line per mode and concurrency: direct p50 p99 rps, then
# p50 p99 rps cpu for the bare hop, the raw hop, nginx and compactor).
issue_table() {
  awk '
    { k = $1 "/" $2; for (i = 3; i <= NF; i++) v[k, i] = $i; seen[$1] = 1 }
    function ms(x) { return sprintf("%.3f", x / 1000) }
    function lat(mode, col, label,   d, h, r, n, c) {
      if (!((mode "/1", 3) in v)) return
      d = v[mode "/1", col]; h = v[mode "/1", col + 3]; r = v[mode "/1", col + 7]; n = v[mode "/1", col + 11]; c = v[mode "/1", col + 15]
      if (col == 3)
        printf "| %s | %s | %s (+%.0f µs) | %s (+%.0f µs) | %s (+%.0f µs) | %s (+%.0f µs) |\n", label, ms(d), ms(h), h - d, ms(r), r - d, ms(n), n - d, ms(c), c - d
      else
        printf "| %s | %s | %s | %s | %s | %s |\n", label, ms(d), ms(h), ms(r), ms(n), ms(c)
    }
    function rps(mode, label) {
      if (!((mode "/64", 3) in v)) return
      printf "| %s | %.0f | %.0f | %.0f | %.0f | %.0f |\n", label, v[mode "/64", 5], v[mode "/64", 8], v[mode "/64", 12], v[mode "/64", 16], v[mode "/64", 20]
    }
    function cpu(mode, conc, label,   n, c) {
      if (!((mode "/" conc, 3) in v)) return
      n = v[mode "/" conc, 17]; c = v[mode "/" conc, 21]
      printf "| %s | — | %.1f µs | %.1f µs | %.1f µs | %.1f µs (%.2fx) |\n", label, v[mode "/" conc, 9], v[mode "/" conc, 13], n, c, (n > 0 ? c / n : 0)
    }
    END {
      print "| | direct | bare hop | raw hop | nginx | compactor |"
      print "|---|---:|---:|---:|---:|---:|"
      lat("json", 3, "c=1 p50, non-stream")
      lat("sse", 3, "c=1 p50, stream")
      lat("json_agent", 3, "c=1 p50, 25 KB agent turn")
      lat("json", 4, "c=1 p99, non-stream")
      lat("sse", 4, "c=1 p99, stream")
      lat("json_agent", 4, "c=1 p99, 25 KB agent turn")
      rps("json", "c=64 req/s, non-stream")
      rps("sse", "c=64 req/s, stream")
      rps("json_agent", "c=64 req/s, 25 KB agent turn")
      cpu("json", 64, "CPU per request, c=64, non-stream")
      cpu("sse", 64, "CPU per request, c=64, stream")
      cpu("json_agent", 64, "CPU per request, c=64, 25 KB agent turn")
      cpu("json", 1, "CPU per request, c=1, non-stream")
      cpu("sse", 1, "CPU per request, c=1, stream")
      cpu("json_agent", 1, "CPU per request, c=1, 25 KB agent turn")
    }' "$1"
}

# median: each column's median over the lines of stdin (one run a line).
median() {
  awk '
    { for (j = 1; j <= NF; j++) v[j, NR] = $j; n = NR; f = NF }
    END {
      for (j = 1; j <= f; j++) {
        for (a = 1; a <= n; a++) col[a] = v[j, a]
        for (a = 1; a <= n; a++) for (b = a + 1; b <= n; b++) if (col[b] + 0 < col[a] + 0) { t = col[a]; col[a] = col[b]; col[b] = t }
        printf "%s%s", col[int((n + 1) / 2)], (j < f ? " " : "\n")
      }
    }'
}

# point MODE CONNS: REPS runs (default 1) of each target, taken in turn
# (direct, bare hop, raw hop, nginx, compactor, then again), each figure
# the median of its target's runs; the runs go to $OUT/runs.<target>.
# On a shared VM one run can be off by 20%, and the machine's speed drifts
# over minutes: taken in turn, the targets compared see the same drift
# (all of one target's runs, then all of the next's, put a drift between
# nginx and compactor into their ratio).
point() {
  local i t
  for t in dir hop raw ngx cmp; do : >"$OUT/runs.$t"; done
  for i in $(seq 1 "${REPS:-1}"); do
    run "$MOCK" "" "$1" "$2" >>"$OUT/runs.dir"
    run "$NAIVE" "$NAIVE_PID" "$1" "$2" >>"$OUT/runs.hop"
    run "$RAW" "$RAW_PID" "$1" "$2" >>"$OUT/runs.raw"
    run "$NGINX_ADDR" "$NGINX_PID" "$1" "$2" >>"$OUT/runs.ngx"
    run "$PROXY" "$PROXY_PID" "$1" "$2" >>"$OUT/runs.cmp"
  done
}

bench_layout() {
  LAYOUT_NOW="$1"
  local load_cpus="" proxy_cpus=""
  LOADGEN=""
  if [ "$LAYOUT_NOW" = pinned ]; then
    load_cpus=0; proxy_cpus=1; LOADGEN="taskset -c 0"
  fi
  start MOCK "$OUT/mock.log" "$load_cpus" "$BIN/examples/mock_upstream" 127.0.0.1:0 "$DELAY"
  start NAIVE "$OUT/naive.log" "$proxy_cpus" "$BIN/examples/naive_proxy" 127.0.0.1:0 "$MOCK"
  start RAW "$OUT/raw.log" "$proxy_cpus" "$BIN/examples/raw_hop" 127.0.0.1:0 "$MOCK"
  start_nginx "$OUT/nginx_$LAYOUT_NOW.log" "$proxy_cpus"
  COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
    start PROXY "$OUT/compactor_$LAYOUT_NOW.log" "$proxy_cpus" "$COMPACTOR_BIN" --config /dev/null

  echo
  echo "== layout: $LAYOUT_NOW   mock upstream $MOCK (delay ${DELAY} ms)   ${DUR}s per run, median of ${REPS:-1}   $(nproc) cores"
  echo "   p50/p99 in µs; rps = requests/s; cpu = proxy CPU µs per request; load average $(cut -d' ' -f1-3 /proc/loadavg)"
  local nginx_log=off
  [ -z "${ACCESS_LOG:-}" ] || nginx_log="on (access_log, unbuffered)"
  echo "   request logs: compactor on (its default), nginx $nginx_log"
  echo "   dir = direct to the mock, hop = bare hyper hop (naive_proxy), raw = hop without HTTP library (raw_hop), ngx = nginx, cmp = compactor"
  printf "%-9s %-3s | %6s %6s %6s | %6s %6s %6s %6s | %6s %6s %6s %6s | %6s %6s %6s %6s | %6s %6s %6s %6s\n" \
    mode conc "dirp50" "dirp99" "dirrps" "hopp50" "hopp99" "hoprps" "hopcpu" \
    "rawp50" "rawp99" "rawrps" "rawcpu" "ngxp50" "ngxp99" "ngxrps" "ngxcpu" "cmpp50" "cmpp99" "cmprps" "cmpcpu"
  : >"$OUT/summary_$LAYOUT_NOW.txt"
  : >"$OUT/table_$LAYOUT_NOW.txt"
  for mode in ${MODES:-json json_big json_agent sse sse_paced}; do
    for conc in 1 64; do
      point "$mode" "$conc"
      read -r d50 d99 drps _ < <(median <"$OUT/runs.dir")
      read -r n50 n99 nrps ncpu < <(median <"$OUT/runs.hop")
      read -r r50 r99 rrps rcpu < <(median <"$OUT/runs.raw")
      read -r g50 g99 grps gcpu < <(median <"$OUT/runs.ngx")
      read -r p50 p99 prps pcpu < <(median <"$OUT/runs.cmp")
      printf "%-9s %-3s | %6.0f %6.0f %6.0f | %6.0f %6.0f %6.0f %6.1f | %6.0f %6.0f %6.0f %6.1f | %6.0f %6.0f %6.0f %6.1f | %6.0f %6.0f %6.0f %6.1f\n" \
        "$mode" "$conc" "$d50" "$d99" "$drps" "$n50" "$n99" "$nrps" "$ncpu" "$r50" "$r99" "$rrps" "$rcpu" \
        "$g50" "$g99" "$grps" "$gcpu" "$p50" "$p99" "$prps" "$pcpu"
      echo "$mode $conc $d50 $d99 $g50 $g99 $gcpu $p50 $p99 $pcpu" >>"$OUT/summary_$LAYOUT_NOW.txt"
      echo "$mode $conc $d50 $d99 $drps $n50 $n99 $nrps $ncpu $r50 $r99 $rrps $rcpu $g50 $g99 $grps $gcpu $p50 $p99 $prps $pcpu" >>"$OUT/table_$LAYOUT_NOW.txt"
    done
  done
  echo
  echo "compactor against nginx (targets: cpu at c=64 <= 1.0x, json_agent <= 1.5x; added p50 at c=1 <= 1.2x; p99 at c=1 <= nginx + 200 µs):"
  awk '{
    if ($2 == 1) printf "  %-9s c=1   added p50: nginx %5.0f µs, compactor %5.0f µs (%.2fx)   p99: nginx %5.0f, compactor %5.0f (%+.0f µs)   cpu/req %.1f vs %.1f µs (%.2fx)\n",
      $1, $5 - $3, $8 - $3, ($5 > $3 ? ($8 - $3) / ($5 - $3) : 0), $6, $9, $9 - $6, $10, $7, ($7 > 0 ? $10 / $7 : 0);
    else printf "  %-9s c=64  cpu/req: nginx %5.1f µs, compactor %5.1f µs (%.2fx)\n", $1, $7, $10, ($7 > 0 ? $10 / $7 : 0)
  }' "$OUT/summary_$LAYOUT_NOW.txt"

  echo
  echo "where the CPU goes, per request (c=64, small JSON, ${DUR}s each, one run):"
  split "$NGINX_ADDR" "$NGINX_PID" nginx
  split "$PROXY" "$PROXY_PID" compactor
  split "$PROXY" "$PROXY_PID" "compactor pass" /v1/embeddings
  syscalls "$NGINX_ADDR" "$NGINX_PID" nginx
  syscalls "$PROXY" "$PROXY_PID" compactor

  echo
  echo "the issue 25 table (markdown; latency in ms, added latency over direct in brackets, CPU in µs per request; load average now $(cut -d' ' -f1-3 /proc/loadavg)):"
  issue_table "$OUT/table_$LAYOUT_NOW.txt"

  echo
  echo "time to first SSE byte (sequential, ${TTFB_N} requests, 1 ms between upstream events):"
  echo "  direct:    $($LOADGEN "$BIN/examples/ttfb" "http://$MOCK/v1/chat/completions?gap_ms=1" "$TTFB_N")"
  echo "  naive:     $($LOADGEN "$BIN/examples/ttfb" "http://$NAIVE/v1/chat/completions?gap_ms=1" "$TTFB_N")"
  echo "  raw hop:   $($LOADGEN "$BIN/examples/ttfb" "http://$RAW/v1/chat/completions?gap_ms=1" "$TTFB_N")"
  echo "  nginx:     $($LOADGEN "$BIN/examples/ttfb" "http://$NGINX_ADDR/v1/chat/completions?gap_ms=1" "$TTFB_N")"
  echo "  compactor: $($LOADGEN "$BIN/examples/ttfb" "http://$PROXY/v1/chat/completions?gap_ms=1" "$TTFB_N")"
  echo
  echo "compactor overhead histogram (total minus upstream wait):"
  curl -s "http://$PROXY/_compactor/metrics" \
    | grep -E "^compactor_proxy_overhead_seconds_(bucket\{le=\"0.000(1|25|5)\"|count)|^compactor_requests_total" || true
  cleanup
  PIDS=()
}

case "$LAYOUT" in
  shared | pinned) bench_layout "$LAYOUT" ;;
  both) bench_layout shared; bench_layout pinned ;;
  *) echo "LAYOUT must be shared, pinned or both" >&2; exit 1 ;;
esac
