#!/bin/bash
# The soft-RoCE suite, run after setup-rxe-pair.sh (rxe0 on 10.99.0.1, rxe1 on 10.99.0.2, GID
# indexes in G0/G1). Not run on its own: `cargo xtask soft-roce` concatenates a generated header
# (MODE, SHARE, REPO, LIVE, OP_SIZE, ITERS, TEST_TIMEOUT, FERRY, TESTS, FERRY_SERVE, FERRY_BENCH,
# FERRY_FAKE_CUDA_PREBUILT),
# setup-rxe-pair.sh and this file into guest-test.sh.
#
# Every result is one line "@@ferry KIND ..." that xtask parses; everything else is log for people.
# The exit status is the number of failures of the guest itself (setup, reference perftests, test
# binaries); a failed ferry bench or doctor is reported on its line and judged by xtask.
up() { cut -d' ' -f1 /proc/uptime; }
now() { date +%s.%N; }
secs() { awk "BEGIN{printf \"%.1f\", $2-$1}"; }
result() { # a result line for xtask, also shown live on the guest console
  echo "@@ferry $*"
  [ -n "${LIVE:-}" ] && [ -w "$LIVE" ] && echo "@@ferry $*" > "$LIVE"
  return 0
}
fails=0
gid() { cat "/sys/class/infiniband/$1/ports/1/gids/$2" 2>/dev/null; }
result setup status=ok mode=$MODE devices=rxe0,rxe1 gids=$G0,$G1 gid0=$(gid rxe0 "$G0") gid1=$(gid rxe1 "$G1") kernel=$(uname -r) cpus=$(nproc) uptime=$(up)

# In the guest, the workspace is shared read-only at its host path, so that test binaries find
# their fixtures (env!("CARGO_MANIFEST_DIR")) and run from their package directory as under cargo.
if [ "$MODE" = guest ] && [ -n "${REPO:-}" ]; then
  mkdir -p "$REPO"
  mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=none repo "$REPO" || echo "note: workspace share not mounted at $REPO"
fi

# --- reference: perftest between the two devices, server on rxe0 <- client on rxe1
# $1 = the perftest, $2 = when (a tag on the result line)
perf() {
  local b=$1 when=$2 srv cli rc src t0 t1 row unit attempt
  srv=$(mktemp); cli=$(mktemp)
  if ! command -v "$b" >/dev/null; then result ref $b when=$when status=failed reason=not-installed; fails=$((fails+1)); return; fi
  # perftest times with the TSC, calibrated against gettimeofday at start; under TCG that
  # calibration fails now and then ("Correlation coefficient r^2 < 0.9") and the rate reads 0.00,
  # so a run without a rate is retried.
  for attempt in 1 2 3; do
    echo "== $b -s $OP_SIZE -n $ITERS (server rxe0 10.99.0.1 <- client rxe1 10.99.0.2), attempt $attempt"
    timeout 180 "$b" -d rxe0 -x "$G0" -s "$OP_SIZE" -n "$ITERS" -F > "$srv" 2>&1 & local s=$!
    sleep 1
    t0=$(now)
    timeout 180 "$b" -d rxe1 -x "$G1" -s "$OP_SIZE" -n "$ITERS" -F 10.99.0.1 > "$cli" 2>&1; rc=$?
    t1=$(now)
    wait $s; src=$?
    cat "$cli"
    # the data row starts with the message size: #bytes #iterations BW-peak BW-average MsgRate
    row=$(awk -v m="$OP_SIZE" '$1==m && NF>=4 && $4>0 {print $1, $2, $4; exit}' "$cli")
    [ "$rc" = 0 ] && [ "$src" = 0 ] && [ -n "$row" ] && break
    echo "-- $b: client rc=$rc server rc=$src, no rate; server log:"; cat "$srv"
  done
  unit=$(grep -o 'BW average\[[^]]*\]' "$cli" | head -1 | sed 's/.*\[\(.*\)\]/\1/')
  if [ "$rc" = 0 ] && [ "$src" = 0 ] && [ -n "$row" ]; then
    set -- $row
    result ref $b when=$when status=ok bytes=$1 iters=$2 bw_avg=$3 unit=$unit wall_s=$(secs "$t0" "$t1") attempts=$attempt
  else
    result ref $b when=$when status=failed reason=client-rc-$rc-server-rc-$src-or-no-rate attempts=$attempt
    fails=$((fails+1))
  fi
  rm -f "$srv" "$cli"
}

# --- the ferry CLI's own view of the devices (a missing subcommand is reported, not fatal)
for sub in doctor topology; do
  echo "== ferry $sub"
  if [ -x "$FERRY" ]; then
    timeout 60 "$FERRY" "$sub"; result cmd $sub rc=$?
  else
    result cmd $sub rc=missing-binary
  fi
done

# --- the project's RDMA test binaries, ignored (hardware) tests included, one test at a time
# (the GPU tests load the fake CUDA drivers the host built: the guest has no compiler)
# FERRY_RDMA_TEST_FLAP: the flap test may create a second rxe pair on a veth link of its own
# (rxeflap0/rxeflap1 on vfa/vfb, 10.99.1.0/24) and take that link down and up.
export FERRY_RDMA_TEST_DEVICES=rxe0,rxe1 FERRY_RDMA_TEST_GIDS=$G0,$G1 FERRY_RDMA_TEST_FLAP=1 RUST_BACKTRACE=1
export FERRY_FAKE_CUDA_PREBUILT
for entry in "${TESTS[@]}"; do
  name=${entry%%|*}; dir=${entry#*|}
  t=$SHARE/tests/$name
  [ -d "$dir" ] || dir=$SHARE
  echo "== (cd $dir && FERRY_RDMA_TEST_DEVICES=$FERRY_RDMA_TEST_DEVICES FERRY_RDMA_TEST_GIDS=$FERRY_RDMA_TEST_GIDS $t --include-ignored --test-threads=1)"
  out=$(mktemp); t0=$(now)
  # timeout signals its whole process group, so processes a test spawned go too (rc 124: timed out)
  (cd "$dir" && timeout -k 10 "$TEST_TIMEOUT" "$t" --include-ignored --test-threads=1) 2>&1 | tee "$out"; rc=${PIPESTATUS[0]}
  t1=$(now)
  [ -z "$(tail -c 1 "$out")" ] || echo  # a killed test leaves its last line unterminated
  line=$(grep '^test result:' "$out" | tail -1)
  count() { echo "$line" | grep -o "[0-9]\+ $1" | grep -o '[0-9]\+' || echo 0; }
  result test $name rc=$rc passed=$(count passed) failed=$(count failed) ignored=$(count ignored) wall_s=$(secs "$t0" "$t1") timeout_s=$TEST_TIMEOUT
  if [ "$rc" != 0 ]; then
    fails=$((fails+1))
    # the kernel's account of a failure (rxe warnings, QP errors), if it left one
    echo "== dmesg (last 40 lines) after $name failed"; dmesg | tail -40
  fi
  rm -f "$out"
done
unset FERRY_RDMA_TEST_DEVICES FERRY_RDMA_TEST_GIDS FERRY_RDMA_TEST_FLAP

# --- ferry's own RDMA WRITE bench between the two devices: same op size, same bytes as ib_write_bw
bench() {
  local srv out addr="" spid rc json cmd t0 t1 p0 p1
  echo "== ferry bench (rdma, write)"
  if ! [ -x "$FERRY" ]; then result bench status=failed reason=no-ferry-binary; return; fi
  srv=$(mktemp); out=$(mktemp)
  echo "\$ $FERRY_SERVE"
  eval "exec $FERRY_SERVE" > "$srv" 2>&1 & spid=$!  # exec: $spid is the server itself
  for _ in $(seq 120); do # up to 60 s for the listen address to be printed
    # The line serve prints once it listens (a log line may name the address too, with port 0).
    addr=$(sed -n 's/^listening on \(10\.99\.0\.1:[0-9][0-9]*\)$/\1/p' "$srv" | head -1)
    [ -n "$addr" ] && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.5
  done
  if [ -z "$addr" ]; then
    echo "-- ferry serve output:"; cat "$srv"
    if kill -0 $spid 2>/dev/null; then
      kill $spid 2>/dev/null; wait $spid 2>/dev/null
      result bench status=failed reason=serve-printed-no-address
    else
      wait $spid; result bench status=failed reason=serve-exited-rc-$?
    fi
    return
  fi
  cmd=${FERRY_BENCH//@ADDR@/$addr}
  echo "\$ $cmd"
  p0=$(rxe_pkts); t0=$(now)
  eval "timeout 300 $cmd" > "$out"; rc=$?
  t1=$(now); p1=$(rxe_pkts)
  cat "$out"
  json=$(grep '^ *{' "$out" | tail -1)
  kill $spid 2>/dev/null; sleep 1; kill -9 $spid 2>/dev/null; wait $spid 2>/dev/null
  echo "-- ferry serve output:"; cat "$srv"
  if [ "$rc" = 0 ] && [ -n "$json" ]; then
    result bench status=ok wall_s=$(secs "$t0" "$t1") rxe_pkts=$([ -n "$p0" ] && [ -n "$p1" ] && echo $((p1 - p0)) || echo unknown) json=$json
  else
    result bench status=failed reason=bench-rc-$rc$([ -n "$json" ] || echo -no-json)
  fi
  rm -f "$srv" "$out"
}
# Packets both rxe devices sent: what the bench moves must show here, or it did not go over RDMA.
rxe_pkts() {
  local a b
  a=$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts 2>/dev/null) || return 0
  b=$(cat /sys/class/infiniband/rxe1/ports/1/hw_counters/sent_pkts 2>/dev/null) || return 0
  echo $((a + b))
}
# The reference runs right before and right after the ferry bench, so that the ratio compares
# rates taken under the same load (TCG on a shared host swings by 2x and more over minutes).
perf ib_write_bw before-bench
perf ib_read_bw before-bench
bench
perf ib_write_bw after-bench

echo "== veth and rxe counters (traffic crossed the veth pair)"
ip -s link show va | sed -n '3,6p'
for d in rxe0 rxe1; do
  echo "$d sent_pkts=$(cat /sys/class/infiniband/$d/ports/1/hw_counters/sent_pkts 2>/dev/null) rcvd_pkts=$(cat /sys/class/infiniband/$d/ports/1/hw_counters/rcvd_pkts 2>/dev/null)"
done
result end fails=$fails uptime=$(up)
exit $fails
