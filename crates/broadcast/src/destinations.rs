//! Where a receiver pulls into ([`Destinations`]), and the match of the published tensors with
//! them, before anything is registered, listed or moved.

use std::collections::HashMap;

use crate::error::BroadcastError;
use crate::layout::Slice;
use crate::manifest::Manifest;

/// Up to 16 of `v`, quoted, and how many more (a hostile manifest may name a million).
fn names<S: AsRef<str>>(v: &[S]) -> String {
    let mut s = v
        .iter()
        .take(16)
        .map(|n| format!("{:?}", n.as_ref()))
        .collect::<Vec<_>>()
        .join(", ");
    if v.len() > 16 {
        s.push_str(&format!(" and {} more", v.len() - 16));
    }
    s
}

/// Where a receiver pulls into: see [`Receiver::join_into`](crate::Receiver::join_into).
#[derive(Clone, Debug, Default)]
pub struct Destinations {
    /// The live tensors: local name and where its bytes go.
    pub into: Vec<(String, Slice)>,
    /// Staged mode: the staging slice of each tensor of `into` (the same names and sizes). The
    /// pull lands here, and [`Receiver::commit`](crate::Receiver::commit) copies it into `into`.
    pub staging: Option<Vec<(String, Slice)>>,
    /// Published name to local name, for tensors whose names differ.
    pub rename: HashMap<String, String>,
    /// Whether published tensors `into` does not name are left out (their bytes still travel,
    /// into scratch memory, verified and relayed) rather than refused.
    pub subset: bool,
    /// Shards: a destination named here takes only its own length of the published tensor,
    /// from this byte offset in it (a tensor-parallel rank's rows of a row-major tensor). The
    /// rest of the tensor travels into scratch memory, verified and relayed.
    pub shards: HashMap<String, u64>,
    /// What a destination holds, where the caller knows it (Python's arrays do): its dtype and
    /// shape are checked against the published entry's before anything moves (the shape not
    /// for shards). A side that does not say is not compared.
    pub kinds: HashMap<String, TensorKind>,
}

/// A tensor's dtype (safetensors' names: `F32`, `BF16`, ...) and shape, each where known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorKind {
    /// The dtype.
    pub dtype: Option<String>,
    /// The shape.
    pub shape: Option<Vec<u64>>,
}

/// Matches the manifest's entries with `d` by name and size: `(entry, index in into)` for each
/// tensor taken, or one [`BroadcastError::Mismatch`] listing every problem. `staging`, when
/// given, is reordered to `into`'s order.
pub(crate) fn match_tensors(
    m: &Manifest,
    d: &Destinations,
) -> Result<Vec<(usize, usize)>, BroadcastError> {
    let mut problems = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, (n, _)) in d.into.iter().enumerate() {
        if index.insert(n.as_str(), i).is_some() {
            problems.push(format!("destination {n:?} is named twice"));
        }
    }
    if let Some(st) = &d.staging {
        let staged: HashMap<&str, &Slice> = st.iter().map(|(n, s)| (n.as_str(), s)).collect();
        for (n, live) in &d.into {
            match staged.get(n.as_str()) {
                None => problems.push(format!("tensor {n:?} has no staging")),
                Some(s) if s.len() != live.len() => problems.push(format!(
                    "tensor {n:?}: staging of {} bytes for a tensor of {}",
                    s.len(),
                    live.len()
                )),
                Some(_) => {}
            }
        }
        if st.len() != d.into.len() {
            problems.push(format!(
                "{} staging slices for {} tensors",
                st.len(),
                d.into.len()
            ));
        }
    }
    let mut published = std::collections::HashSet::new();
    for e in &m.entries {
        if !published.insert(e.name.as_str()) {
            problems.push(format!("tensor {:?} is published twice", e.name));
        }
    }
    let mut matched = Vec::new();
    let mut used: Vec<Option<&str>> = vec![None; d.into.len()];
    let mut extra = Vec::new();
    for (e, entry) in m.entries.iter().enumerate() {
        let local = d.rename.get(&entry.name).unwrap_or(&entry.name);
        match index.get(local.as_str()) {
            Some(&i) => {
                if let Some(first) = used[i].replace(entry.name.as_str()) {
                    problems.push(format!(
                        "destination {local:?} would take two published tensors, {first:?} and \
                         {:?}",
                        entry.name
                    ));
                    continue;
                }
                if let Some(k) = d.kinds.get(local) {
                    if let (Some(want), Some(got)) = (&entry.dtype, &k.dtype)
                        && want != got
                    {
                        problems.push(format!(
                            "tensor {local:?}: published as {want}, destination is {got}"
                        ));
                        continue;
                    }
                    if let (Some(want), Some(got), false) =
                        (&entry.shape, &k.shape, d.shards.contains_key(local))
                        && want != got
                    {
                        problems.push(format!(
                            "tensor {local:?}: published with shape {want:?}, destination has {got:?}"
                        ));
                        continue;
                    }
                }
                let have = d.into[i].1.len();
                match d.shards.get(local) {
                    None if have != entry.len => problems.push(format!(
                        "tensor {local:?}: published with {} bytes, destination has {have}",
                        entry.len
                    )),
                    Some(&at) if at.checked_add(have).is_none_or(|end| end > entry.len) => problems
                        .push(format!(
                            "tensor {local:?}: a shard of {have} bytes at {at} does not fit the \
                             {} bytes published",
                            entry.len
                        )),
                    _ => matched.push((e, i)),
                }
            }
            None if d.subset => {}
            None => extra.push(local.clone()),
        }
    }
    if !extra.is_empty() {
        problems.push(format!("published but not received: {}", names(&extra)));
    }
    let missing: Vec<&str> = d
        .into
        .iter()
        .zip(&used)
        .filter(|(_, u)| u.is_none())
        .map(|((n, _), _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        problems.push(format!("not published: {}", names(&missing)));
    }
    if problems.is_empty() {
        Ok(matched)
    } else {
        Err(BroadcastError::Mismatch {
            name: m.name.clone(),
            version: m.version,
            problems,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Chunk, Digest, Entry, Segment};
    use ferry::{Access, DataPlane, MemoryRegion, TransferEngine};

    fn manifest(entries: &[(&str, u64, u64)]) -> Manifest {
        Manifest {
            name: "w".into(),
            version: 3,
            chunk_size: 4096,
            segments: vec![Segment {
                name: "s".into(),
                len: 4096,
            }],
            entries: entries
                .iter()
                .map(|&(name, offset, len)| Entry {
                    name: name.into(),
                    len,
                    dtype: None,
                    shape: None,
                    segment: 0,
                    offset,
                })
                .collect(),
            chunks: vec![Chunk {
                segment: 0,
                offset: 0,
                len: 4096,
                crc32c: 0,
                blake3: Digest::default(),
            }],
        }
    }

    #[test]
    fn every_mismatch_is_listed_once_and_a_name_published_twice_is_refused() {
        let engine = TransferEngine::builder()
            .data_plane(DataPlane::Tcp)
            .build()
            .unwrap();
        let reg = engine
            .register(MemoryRegion::from_vec(vec![0; 4096]), Access::LOCAL, "d")
            .unwrap();
        let at = |off, len| Slice::new(&reg, "d", off, len).unwrap();
        let m = manifest(&[("a", 0, 100), ("b", 100, 100), ("c", 200, 100)]);
        let d = Destinations {
            into: vec![
                ("a".into(), at(0, 100)),
                ("b".into(), at(100, 50)),
                ("z".into(), at(200, 8)),
            ],
            ..Default::default()
        };
        let Err(BroadcastError::Mismatch {
            problems, version, ..
        }) = match_tensors(&m, &d)
        else {
            panic!("expected a mismatch");
        };
        assert_eq!(version, 3);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("\"b\"") && p.contains("50"))
        );
        assert!(problems.iter().any(|p| p.contains("\"c\"")));
        assert!(problems.iter().any(|p| p.contains("\"z\"")));
        // A manifest of many tensors none of which is received: the message stays short.
        let many: Vec<(String, u64, u64)> = (0..1000).map(|i| (format!("t{i}"), i, 1)).collect();
        let many: Vec<(&str, u64, u64)> =
            many.iter().map(|(n, o, l)| (n.as_str(), *o, *l)).collect();
        let Err(e) = match_tensors(&manifest(&many), &Destinations::default()) else {
            panic!("expected a mismatch");
        };
        assert!(e.to_string().contains("and 984 more"), "{e}");
        assert!(e.to_string().len() < 1000);
        // A hostile manifest naming one tensor twice is refused, not written twice.
        let m = manifest(&[("a", 0, 100), ("a", 100, 100)]);
        let d = Destinations {
            into: vec![("a".into(), at(0, 100))],
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains("twice")
        ));
        // Two published tensors renamed into one destination: refused, not written twice.
        let m = manifest(&[("a", 0, 100), ("b", 100, 100)]);
        let d = Destinations {
            into: vec![("x".into(), at(0, 100))],
            rename: [("a".into(), "x".into()), ("b".into(), "x".into())].into(),
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems.iter().any(|p| p.contains("two published"))
        ));
        // The same bytes under another dtype or shape: refused where the destination says.
        let mut m = manifest(&[("a", 0, 16)]);
        m.entries[0].dtype = Some("BF16".into());
        m.entries[0].shape = Some(vec![8]);
        let kind = |dtype: &str, shape: Vec<u64>| TensorKind {
            dtype: Some(dtype.into()),
            shape: Some(shape),
        };
        let with = |k: TensorKind| Destinations {
            into: vec![("a".into(), at(0, 16))],
            kinds: [("a".into(), k)].into(),
            ..Default::default()
        };
        let refused = |d: &Destinations, what: &str| {
            matches!(match_tensors(&m, d),
                Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains(what))
        };
        assert!(refused(
            &with(kind("F32", vec![4])),
            "published as BF16, destination is F32"
        ));
        assert!(refused(&with(kind("BF16", vec![2, 4])), "shape"));
        assert!(match_tensors(&m, &with(kind("BF16", vec![8]))).is_ok());
        assert!(match_tensors(&m, &with(TensorKind::default())).is_ok());
        // Staging must match `into` name for name and size.
        let m = manifest(&[("a", 0, 100)]);
        let d = Destinations {
            into: vec![("a".into(), at(0, 100))],
            staging: Some(vec![("a".into(), at(100, 99))]),
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains("staging")
        ));
    }
}
