#!/bin/bash
# Boot the soft-RoCE guest once: runs $SHARE/guest-test.sh inside, then powers off.
# Env: ACCEL=tcg|kvm (default tcg; kvm does NOT boot a stock kernel on this host, see report), SHARE=dir (9p, tag hostshare),
#      REPO (optional second share), MEM (MiB), SMP, TIMEOUT (s). Guest has NO network device at all (-nic none).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${SOFT_ROCE_DIR:-$HOME/.cache/ferry/soft-roce}; mkdir -p "$STATE"
SHARE=${SHARE:?set SHARE to a folder holding guest-test.sh}; MEM=${MEM:-2048}; SMP=${SMP:-2}; TIMEOUT=${TIMEOUT:-600}
ACCEL=${ACCEL:-tcg}
# REPO=dir: a second, read-only 9p share (tag repo) that the guest test mounts at the same path.
EXTRA=(); [ -n "${REPO:-}" ] && EXTRA=(-virtfs local,path="$REPO",mount_tag=repo,security_model=none,readonly=on,id=repo)
# KVM here (nested, PVM-based) only starts Linux via the PVH ELF entry (uncompressed vmlinux);
# the bzImage path hangs in the real-mode/decompressor stage. TCG can use either.
KERNEL=${KERNEL:-$STATE/vmlinux}; [ -f "$KERNEL" ] || KERNEL=$STATE/vmlinuz
case "$ACCEL" in
  kvm) ACC=(-accel kvm -cpu "${KVM_CPU:-host,-cx16}") ;;  # -cx16: nested PVM cannot emulate cmpxchg16b
  tcg) ACC=(-accel tcg,thread=multi,tb-size=256 -cpu max) ;;
esac
rm -f "$SHARE/result.log"
start=$(date +%s.%N)
set +e
timeout --foreground "$TIMEOUT" qemu-system-x86_64 "${ACC[@]}" -machine q35 -m "$MEM" -smp "$SMP" \
  -nographic -nodefaults -no-reboot -serial stdio -nic none \
  -kernel "$KERNEL" -initrd "$STATE/initrd.img" \
  -append "console=ttyS0 root=/dev/vda rw rootfstype=ext4 init=/sbin/rxe-init panic=1 quiet loglevel=4 edd=off no_timer_check ${APPEND:-}" \
  -drive file="$STATE/rootfs.img",if=virtio,format=raw,snapshot=on \
  -virtfs local,path="$SHARE",mount_tag=hostshare,security_model=none,id=hostshare "${EXTRA[@]}" \
  | tee "${CONSOLE:-$STATE/console.log}"
rc=${PIPESTATUS[0]}
set -e
echo "run-vm: qemu rc=$rc, wall $(awk "BEGIN{print $(date +%s.%N)-$start}")s (accel=$ACCEL)"
[ -f "$SHARE/result.log" ] && grep -q 'guest-test.sh exit=0' "$SHARE/result.log"
