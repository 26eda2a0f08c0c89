#!/bin/bash
# Build a minimal Debian bookworm rootfs for soft-RoCE (rdma_rxe) testing.
# Run by `cargo xtask soft-roce` as root (output: $SOFT_ROCE_DIR/rootfs, kernel+initrd in its /boot).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${SOFT_ROCE_DIR:-$HOME/.cache/ferry/soft-roce}; mkdir -p "$STATE"
ROOTFS=${ROOTFS:-$STATE/rootfs}
# Reuse the exact mirror apt is configured with.
# Elsewhere (an Ubuntu runner has no Debian mirror configured) use the Debian CDN.
MIRROR=${MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PKGS=linux-image-amd64,initramfs-tools,kmod,iproute2,rdma-core,ibverbs-providers,ibverbs-utils,perftest,libibverbs1,procps
start=$(date +%s)
if [ "${SKIP_DEBOOTSTRAP:-0}" != 1 ]; then
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include="$PKGS" bookworm "$ROOTFS" "$MIRROR"
  echo "debootstrap took $(( $(date +%s) - start ))s"
  sed -i 's/^MODULES=.*/MODULES=list/' "$ROOTFS/etc/initramfs-tools/initramfs.conf"
  printf 'virtio_pci\nvirtio_blk\next4\ncrc32c_generic\n' >> "$ROOTFS/etc/initramfs-tools/modules"
fi

R=$ROOTFS
KVER=$(ls "$R/lib/modules" | head -1)
# 1. Small initramfs: only what is needed to mount an ext4 root on virtio-blk.
#    (done right after debootstrap above)
# 2. Trim: unneeded kernel modules, docs, apt caches (image shrinks ~770M -> ~250M).
M=$R/lib/modules/$KVER/kernel
rm -rf "$M/sound" "$M/drivers/"{gpu,media,staging,iio,usb,hwmon,hid,platform,scsi,md,input,isdn,bluetooth,mmc,mtd,thunderbolt,video,nfc,w1,power,leds,edac,firewire,ata} \
       "$M/drivers/net/"{wireless,ethernet,usb,can,wwan,ieee802154,hamradio,ipa,fddi,arcnet,plip,slip,ppp,wan} \
       "$M/net/"{wireless,mac80211,bluetooth,sunrpc,ceph,nfc} "$M/fs/"{nfs,nfsd,ceph,ocfs2,gfs2,xfs,btrfs,bcachefs,smb,cifs,ntfs3,f2fs,jfs,reiserfs,ubifs,nilfs2}
rm -rf "$R/var/cache/apt/archives/"*.deb "$R/var/lib/apt/lists/"* "$R/usr/share/"{doc,man,locale,info}/* "$R/boot/"*.dpkg-bak "$R/boot/"*.new
chroot "$R" depmod -a "$KVER"
chroot "$R" update-initramfs -u -k "$KVER"
rm -f "$R/boot/"*.dpkg-bak "$R/boot/"*.new
# 3. Guest PID 1: mounts, 9p host share, runs <share>/guest-test.sh, powers off.
install -m 0755 "$HERE/guest-init.sh" "$R/sbin/rxe-init"
echo rxe-guest > "$R/etc/hostname"
echo "rootfs built in $(( $(date +%s) - start ))s; $(du -sh "$R" | cut -f1)"
