#!/bin/bash
# Pack $SOFT_ROCE_DIR/rootfs into an ext4 image without root loop mounts (mkfs.ext4 -d).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${SOFT_ROCE_DIR:-$HOME/.cache/ferry/soft-roce}; mkdir -p "$STATE"
ROOTFS=${ROOTFS:-$STATE/rootfs}; IMG=${IMG:-$STATE/rootfs.img}
KVER=$(ls "$ROOTFS/lib/modules" | head -1)
cp "$ROOTFS/boot/vmlinuz-$KVER" "$STATE/vmlinuz"; cp "$ROOTFS/boot/initrd.img-$KVER" "$STATE/initrd.img"
# uncompressed ELF vmlinux for PVH direct boot (the only way the kernel starts under this host's KVM);
# optional: TCG boots the compressed vmlinuz as well
rm -f "$STATE/vmlinux"
command -v python3 >/dev/null && python3 -c 'import lzma,sys;d=open(sys.argv[1],"rb").read();o=d.find(b"\xfd7zXZ\x00");open(sys.argv[2],"wb").write(lzma.LZMADecompressor().decompress(d[o:]))' "$STATE/vmlinuz" "$STATE/vmlinux"
SZ=$(( $(du -sm "$ROOTFS" | cut -f1) * 13 / 10 + 64 ))
rm -f "$IMG"; truncate -s ${SZ}M "$IMG"
mkfs.ext4 -q -F -L rxe-root -d "$ROOTFS" "$IMG"
echo "image $IMG: ${SZ}M apparent, $(du -sh "$IMG" | cut -f1) on disk"
