//! A registration cache: registering the same pages again shares the native copy already made.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::{Access, MemoryRegion};

use crate::backend::{ContextId, ContextInfo, NativeError, NativeHandle, RegistrationBackend};

/// A [`RegistrationBackend`] that shares native copies between registrations of the same
/// pages: a copy asked for on a context with an access and a host range (start address and
/// length) that an existing copy already has returns that copy, reference-counted; the copy is
/// destroyed when the last registration using it retires.
///
/// **What "the same pages" means, and why it is sound.** Only host memory is shared (device
/// memory goes straight through), and only an exact match: same context, same access, same
/// start and length. A copy exists only while a registration that holds its region (an
/// `Arc<MemoryRegion>`, which keeps the bytes allocated and in place) has not retired, so while
/// an entry lives its address range still maps the pages it was registered with; memory that
/// was freed cannot be matched, because it cannot be freed while an entry names it, and an
/// entry goes with its last registration (invalidation is the reference count reaching zero,
/// never a guess about the allocator). A range inside a larger registered one is not shared: a
/// remote copy's key would open the whole larger range to peers.
///
/// Handles given out are the cache's own (unique ids; the inner backend's keys), so two
/// registrations that share a copy each destroy "their" handle, and only the last destroy
/// reaches the inner backend. Budgets still charge each registration's copies in full (the
/// registry counts what was asked for). Two registrations of the same pages racing each other
/// may both miss; the second copy is then made and destroyed on its own, uncached.
pub struct SharedCopies {
    inner: Arc<dyn RegistrationBackend>,
    state: Mutex<State>,
    next: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// What identifies the same pages on one context.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    context: ContextId,
    access: Access,
    addr: usize,
    len: usize,
}

#[derive(Debug)]
struct Entry {
    inner: NativeHandle,
    refs: u64,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<Key, Entry>,
    /// Every handle given out: the key it shares, or the inner handle of an uncached copy.
    handles: HashMap<u64, Given>,
}

#[derive(Clone, Copy, Debug)]
enum Given {
    Shared(Key),
    Own(NativeHandle),
}

/// How often registrations shared a copy.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
#[non_exhaustive]
pub struct CacheStats {
    /// Copies asked for that an existing copy served.
    pub hits: u64,
    /// Copies the inner backend made.
    pub misses: u64,
    /// Distinct copies alive now.
    pub entries: u64,
}

impl SharedCopies {
    /// A cache in front of `inner`.
    pub fn new(inner: Arc<dyn RegistrationBackend>) -> Self {
        Self {
            inner,
            state: Mutex::new(State::default()),
            next: AtomicU64::new(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Hits, misses and live copies.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.state().entries.len() as u64,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give(&self, state: &mut State, inner: NativeHandle, given: Given) -> NativeHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        state.handles.insert(id, given);
        NativeHandle { id, ..inner }
    }
}

impl fmt::Debug for SharedCopies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedCopies")
            .field("inner", &self.inner)
            .field("stats", &self.stats())
            .finish()
    }
}

impl RegistrationBackend for SharedCopies {
    fn contexts(&self) -> Vec<ContextInfo> {
        self.inner.contexts()
    }

    fn register_copy(
        &self,
        context: ContextId,
        region: &MemoryRegion,
        access: Access,
    ) -> Result<NativeHandle, NativeError> {
        if !region.is_host() {
            let inner = self.inner.register_copy(context, region, access)?;
            return Ok(self.give(&mut self.state(), inner, Given::Own(inner)));
        }
        let key = Key {
            context,
            access,
            addr: region.as_ptr() as usize,
            len: region.len(),
        };
        {
            let mut state = self.state();
            if let Some(e) = state.entries.get_mut(&key) {
                e.refs += 1;
                let inner = e.inner;
                self.hits.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%context, len = key.len, %access, "registration shared");
                return Ok(self.give(&mut state, inner, Given::Shared(key)));
            }
        }
        // Made outside the lock: a registration of many GiB takes long.
        let inner = self.inner.register_copy(context, region, access)?;
        self.misses.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state();
        if state.entries.contains_key(&key) {
            return Ok(self.give(&mut state, inner, Given::Own(inner)));
        }
        state.entries.insert(key, Entry { inner, refs: 1 });
        Ok(self.give(&mut state, inner, Given::Shared(key)))
    }

    fn destroy_copy(&self, context: ContextId, handle: NativeHandle) -> Result<(), NativeError> {
        let inner = {
            let mut state = self.state();
            match state.handles.get(&handle.id).copied() {
                // Not ours (never given out, or already destroyed): the inner backend decides.
                None => handle,
                Some(Given::Own(inner)) => {
                    state.handles.remove(&handle.id);
                    inner
                }
                Some(Given::Shared(key)) => {
                    state.handles.remove(&handle.id);
                    let Some(e) = state.entries.get_mut(&key) else {
                        return Ok(());
                    };
                    e.refs -= 1;
                    if e.refs > 0 {
                        return Ok(());
                    }
                    let inner = e.inner;
                    state.entries.remove(&key);
                    inner
                }
            }
        };
        // A failure leaves the registration unquiesced in the registry, which retries with the
        // same handle: it then owns the inner copy alone, so the retry reaches it.
        self.inner.destroy_copy(context, inner).inspect_err(|_| {
            if handle.id != inner.id {
                self.state().handles.insert(handle.id, Given::Own(inner));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Budgets, Registry};
    use std::sync::atomic::AtomicBool;

    /// One context; handles numbered from 1; counts what it made and destroyed, and can fail
    /// the next destroy.
    #[derive(Debug, Default)]
    struct Counting {
        made: AtomicU64,
        destroyed: Mutex<Vec<u64>>,
        fail_next_destroy: AtomicBool,
    }

    impl RegistrationBackend for Counting {
        fn contexts(&self) -> Vec<ContextInfo> {
            vec![ContextInfo::new(ContextId(0), "fake:1")]
        }
        fn register_copy(
            &self,
            _: ContextId,
            _: &MemoryRegion,
            access: Access,
        ) -> Result<NativeHandle, NativeError> {
            let id = self.made.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(NativeHandle {
                id,
                lkey: 100 + id as u32,
                rkey: if access.is_remote() {
                    200 + id as u32
                } else {
                    0
                },
            })
        }
        fn destroy_copy(&self, _: ContextId, h: NativeHandle) -> Result<(), NativeError> {
            if self.fail_next_destroy.swap(false, Ordering::SeqCst) {
                return Err(NativeError::new(
                    "fake:1",
                    "ibv_dereg_mr",
                    std::io::Error::from_raw_os_error(16),
                ));
            }
            self.destroyed.lock().unwrap().push(h.id);
            Ok(())
        }
    }

    fn setup() -> (Registry, Arc<Counting>, Arc<SharedCopies>) {
        let inner = Arc::new(Counting::default());
        let cache = Arc::new(SharedCopies::new(inner.clone()));
        (
            Registry::new(cache.clone(), Budgets::UNLIMITED),
            inner,
            cache,
        )
    }

    fn rw() -> Access {
        Access::REMOTE_READ | Access::REMOTE_WRITE
    }

    /// The same pages registered twice share their copies (same keys, one native call per copy),
    /// each registration with its own token; the copies go with the last registration only.
    #[test]
    fn the_same_pages_share_copies_until_the_last_registration_goes() {
        let (reg, inner, cache) = setup();
        let region = Arc::new(MemoryRegion::from_vec(vec![1; 4096]));
        let a = reg.register("a", region.clone(), rw()).unwrap();
        let b = reg.register("b", region.clone(), rw()).unwrap();
        assert_eq!(
            inner.made.load(Ordering::SeqCst),
            2,
            "local and remote copy, once"
        );
        assert_ne!(a.token(), b.token());
        let ctx = ContextId(0);
        assert_eq!(a.lease().local_key(ctx), b.lease().local_key(ctx));
        assert_eq!(a.lease().remote_key(ctx), b.lease().remote_key(ctx));
        assert_eq!(
            cache.stats(),
            CacheStats {
                hits: 2,
                misses: 2,
                entries: 2
            }
        );
        drop(a);
        assert!(
            inner.destroyed.lock().unwrap().is_empty(),
            "b still uses them"
        );
        assert_eq!(b.region().as_ptr(), region.as_ptr());
        drop(b);
        let mut destroyed = inner.destroyed.lock().unwrap().clone();
        destroyed.sort();
        assert_eq!(destroyed, [1, 2]);
        assert_eq!(cache.stats().entries, 0);
    }

    /// Retiring the last registration invalidates its copies: the same pages registered again
    /// (the same allocation, at the same address) get fresh copies, never the destroyed ones;
    /// so does memory freed and allocated anew.
    #[test]
    fn a_retired_copy_is_never_handed_out_again() {
        let (reg, inner, cache) = setup();
        let region = Arc::new(MemoryRegion::from_vec(vec![1; 8192]));
        let first = reg.register("w", region.clone(), Access::LOCAL).unwrap();
        let key = first.lease().local_key(ContextId(0));
        first.retire().unwrap();
        assert_eq!(*inner.destroyed.lock().unwrap(), [1]);
        let again = reg.register("w", region.clone(), Access::LOCAL).unwrap();
        assert_ne!(
            again.lease().local_key(ContextId(0)),
            key,
            "a destroyed copy came back"
        );
        assert_eq!(inner.made.load(Ordering::SeqCst), 2);
        drop(again);
        drop(region);
        // Freed; whatever the allocator hands out next (perhaps the same address) is new.
        let fresh = reg
            .register(
                "w",
                Arc::new(MemoryRegion::from_vec(vec![2; 8192])),
                Access::LOCAL,
            )
            .unwrap();
        assert_eq!(inner.made.load(Ordering::SeqCst), 3);
        assert_eq!(cache.stats().hits, 0);
        drop(fresh);
        assert_eq!(cache.stats().entries, 0);
    }

    /// Only an exact match shares: a registration with another access gets remote copies of
    /// its own (and shares the local one).
    #[test]
    fn another_access_gets_its_own_remote_copy() {
        let (reg, inner, cache) = setup();
        let bytes: Arc<MemoryRegion> = Arc::new(MemoryRegion::from_vec(vec![3; 8192]));
        let whole = reg.register("whole", bytes.clone(), rw()).unwrap();
        let read_only = reg
            .register("ro", bytes.clone(), Access::REMOTE_READ)
            .unwrap();
        // The read-only registration shares the local copy only.
        assert_eq!(inner.made.load(Ordering::SeqCst), 3);
        assert_ne!(
            whole.lease().remote_key(ContextId(0)),
            read_only.lease().remote_key(ContextId(0))
        );
        assert_eq!(cache.stats().hits, 1);
        drop((whole, read_only));
        assert_eq!(inner.destroyed.lock().unwrap().len(), 3);
    }
    /// A destroy that fails leaves the registration unquiesced; the registry's retry reaches
    /// the inner backend with the same copy.
    #[test]
    fn a_failed_destroy_is_retried_on_the_inner_copy() {
        let (reg, inner, cache) = setup();
        let r = reg
            .register(
                "x",
                Arc::new(MemoryRegion::from_vec(vec![0; 64])),
                Access::LOCAL,
            )
            .unwrap();
        inner.fail_next_destroy.store(true, Ordering::SeqCst);
        drop(r);
        assert!(inner.destroyed.lock().unwrap().is_empty());
        assert_eq!(reg.counters().unquiesced, 1);
        let retry = reg.retry_unquiesced();
        assert!(retry.still_held.is_empty(), "{retry:?}");
        assert_eq!(*inner.destroyed.lock().unwrap(), [1]);
        assert_eq!(cache.stats().entries, 0);
    }
}
