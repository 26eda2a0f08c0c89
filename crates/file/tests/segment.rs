//! `ferry-file` on its own: sub-ranges, access and bounds checks, the positioned-read loader
//! and when O_DIRECT is offered.

use std::path::{Path, PathBuf};

use ferry_core::{Access, FileSource, MemoryRegion, OpKind, RemoteStatus};
use ferry_file::{DIRECT_ALIGN, FileError, FileSegment, read_file_into};

/// A file of `len` bytes whose byte `i` is `i * 31 + 7` (mod 256).
fn pattern_file(dir: &Path, name: &str, len: usize) -> (PathBuf, Vec<u8>) {
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
    let path = dir.join(name);
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

fn region_bytes(region: &MemoryRegion, at: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    region.read_at(at, &mut v).unwrap();
    v
}

#[test]
fn a_sub_range_checks_access_then_bounds_and_never_grows_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = pattern_file(dir.path(), "sub", 10_000);
    assert!(matches!(
        FileSegment::open_range(&path, 9_000, 1_001, Access::REMOTE_READ),
        Err(FileError::OutOfRange { what: "file", .. })
    ));
    let ro = FileSegment::open_range(&path, 1_000, 5_000, Access::REMOTE_READ).unwrap();
    assert_eq!((ro.base(), ro.len(), ro.is_empty()), (1_000, 5_000, false));
    assert_eq!(ro.check(OpKind::Read, 10, 20), Ok(1_010));
    assert_eq!(
        ro.check(OpKind::Read, 4_990, 11),
        Err(RemoteStatus::OutOfBounds)
    );
    assert_eq!(
        ro.check(OpKind::Write, 0, 1),
        Err(RemoteStatus::AccessDenied)
    );
    let mut buf = [0u8; 20];
    FileSource::read_exact_at(&ro, ro.check(OpKind::Read, 10, 20).unwrap(), &mut buf).unwrap();
    assert_eq!(buf[..], data[1_010..1_030]);

    let rw = FileSegment::open_range(
        &path,
        9_000,
        1_000,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    )
    .unwrap();
    let at = rw.check(OpKind::Write, 990, 10).unwrap();
    FileSource::write_all_at(&rw, at, &[0xee; 10]).unwrap();
    assert_eq!(std::fs::read(&path).unwrap()[9_990..], [0xee; 10]);
    // The file shrank: a WRITE inside the segment but past the file's end now is refused.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(9_500)
        .unwrap();
    assert_eq!(
        rw.check(OpKind::Write, 490, 20),
        Err(RemoteStatus::OutOfBounds)
    );
    assert_eq!(rw.check(OpKind::Write, 480, 20), Ok(9_480));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 9_500);
}

#[test]
fn read_file_into_loads_unaligned_ranges_and_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    let len = (3 << 20) + 777;
    let (path, data) = pattern_file(dir.path(), "whole", len);
    let region = MemoryRegion::alloc_zeroed(len + 8192, 4096).unwrap();
    for &(ro, fo, n) in &[
        (0u64, 0u64, len as u64),
        (4096, 8192, 2 << 20),
        (13, 1, (len - 1) as u64),
        (5, len as u64, 0),
    ] {
        assert_eq!(read_file_into(&region, ro, &path, fo, n).unwrap(), n);
        assert!(
            region_bytes(&region, ro, n as usize) == data[fo as usize..(fo + n) as usize],
            "{ro} {fo} {n}"
        );
    }
    assert!(matches!(
        read_file_into(&region, 0, &path, 1, len as u64),
        Err(FileError::OutOfRange { what: "file", .. })
    ));
    assert!(matches!(
        read_file_into(&region, 8193, &path, 0, len as u64),
        Err(FileError::OutOfRange { what: "region", .. })
    ));
    let missing = dir.path().join("missing");
    match read_file_into(&region, 0, &missing, 0, 1) {
        Err(e @ FileError::OpenFile { .. }) => {
            assert!(
                e.to_string().contains(&missing.display().to_string()),
                "{e}"
            );
            let core: ferry_core::Error = e.into();
            assert!(core.to_string().contains("missing"), "{core}");
        }
        other => panic!("expected OpenFile, got {other:?}"),
    }
}

#[test]
fn a_segment_reads_into_memory_relative_to_its_base() {
    let dir = tempfile::tempdir().unwrap();
    let (path, data) = pattern_file(dir.path(), "part", 50_000);
    let seg = FileSegment::open_range(&path, 7_000, 30_000, Access::REMOTE_READ).unwrap();
    let region = MemoryRegion::alloc_zeroed(40_000, 4096).unwrap();
    assert_eq!(seg.read_into(&region, 3, 100, 29_900).unwrap(), 29_900);
    assert!(region_bytes(&region, 3, 29_900) == data[7_100..37_000]);
    assert!(matches!(
        seg.read_into(&region, 0, 100, 29_901),
        Err(FileError::OutOfRange {
            what: "file segment",
            ..
        })
    ));
}

#[test]
fn o_direct_is_offered_only_for_aligned_reads() {
    // tmpfs refuses O_DIRECT; /var/tmp is usually a disk.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (path, _) = pattern_file(dir.path(), "direct", 4 * 4096);
    let seg = FileSegment::open(&path, Access::REMOTE_READ).unwrap();
    let a = DIRECT_ALIGN as usize;
    assert!(!seg.read_fd(1, 4096, a).1);
    assert!(!seg.read_fd(4096, 100, a).1);
    assert!(!seg.read_fd(4096, 4096, a + 1).1);
    assert_eq!(seg.read_fd(4096, 4096, a).1, seg.direct_capable());
}
