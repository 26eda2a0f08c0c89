#!/bin/bash
# Host mode only (`cargo xtask soft-roce --host`), placed before setup-rxe-pair.sh: removes what that
# script adds to the host (rxe0/rxe1, the va/vb veth pair, the policy routing rules and table 100),
# once first for leftovers of an interrupted run, and again on exit. The rules are deleted by their
# full selector, so rules of the host's own are left alone.
ulimit -l unlimited            # RDMA memory registration pins pages
teardown() {
  rdma link delete rxe0 2>/dev/null; rdma link delete rxe1 2>/dev/null
  ip link del va 2>/dev/null
  # what the flap test (crates/transport-rdma/tests/rxe.rs) leaves should it be killed
  rdma link delete rxeflap0 2>/dev/null; rdma link delete rxeflap1 2>/dev/null
  ip link del vfa 2>/dev/null
  ip rule del pref 12 iif vfa lookup local 2>/dev/null
  ip rule del pref 13 iif vfb lookup local 2>/dev/null
  ip rule show | grep -q '^0:.*lookup local' || ip rule add pref 0 lookup local
  ip rule del pref 10 iif va lookup local 2>/dev/null
  ip rule del pref 11 iif vb lookup local 2>/dev/null
  ip rule del pref 20 lookup 100 2>/dev/null
  ip rule del pref 30 lookup local 2>/dev/null
  ip route flush table 100 2>/dev/null
  return 0
}
teardown
trap teardown EXIT
