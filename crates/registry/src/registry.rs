//! The registry: admission against budgets, fan-out over contexts, publication, leases, retirement.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use ferry_core::{Access, MemoryRegion, SegmentToken};

use crate::backend::{ContextId, ContextInfo, NativeError, NativeHandle, RegistrationBackend};
use crate::error::{AccessError, Budget, RegistryError};

/// Aggregate limits on native copies. Each copy charges the full length of its range.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Budgets {
    /// Most native copies held at once (RDMA: MRs), over all contexts.
    pub max_copies: u64,
    /// Most bytes held at once, summed over copies (a range with 4 copies charges 4 times its length).
    pub max_bytes: u64,
}

impl Budgets {
    /// No practical limit.
    pub const UNLIMITED: Budgets = Budgets {
        max_copies: u64::MAX,
        max_bytes: u64::MAX,
    };
}

impl Default for Budgets {
    /// 65 536 copies (well below the MR limit of common RNICs) and no byte limit.
    fn default() -> Self {
        Self {
            max_copies: 65_536,
            max_bytes: u64::MAX,
        }
    }
}

/// What a native copy is for.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum CopyRole {
    /// The local copy every range gets on every context (RDMA: the lkey used in local SGEs).
    Local,
    /// The copy peers address (RDMA: the rkey), made only for remotely accessible ranges.
    Remote,
}

/// One native copy of a registered range on one context.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct NativeCopy {
    /// The context it lives on.
    pub context: ContextId,
    /// What it is for.
    pub role: CopyRole,
    /// The access it was registered with ([`Access::LOCAL`] for the local copy).
    pub access: Access,
    /// The backend's handle, with its keys.
    pub handle: NativeHandle,
}

/// Where a registration is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SegmentState {
    /// Charged against the budgets; native copies being made. Not visible.
    Admitted,
    /// Every copy exists; remotely accessible ranges are visible under their token.
    Published,
    /// Unpublished (lookup no longer finds it); waiting for the last lease to go.
    Retiring,
    /// Every native copy destroyed and every charge released.
    Retired,
    /// A native destroy failed; copies, memory and charges stay held.
    Unquiesced,
}

impl SegmentState {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => SegmentState::Admitted,
            1 => SegmentState::Published,
            2 => SegmentState::Retiring,
            3 => SegmentState::Retired,
            _ => SegmentState::Unquiesced,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            SegmentState::Admitted => 0,
            SegmentState::Published => 1,
            SegmentState::Retiring => 2,
            SegmentState::Retired => 3,
            SegmentState::Unquiesced => 4,
        }
    }
}

/// What [`Registration::retire`] achieved.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Retirement {
    /// No lease was left: every native copy is destroyed and every charge released.
    Retired,
    /// Leases are still held; the copies are destroyed when the last one drops, and a failure
    /// then is reported by [`Registry::take_errors`].
    Deferred,
}

/// Per-context counters.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ContextCounters {
    /// The context.
    pub id: ContextId,
    /// Its name.
    pub name: String,
    /// Native copies that exist on it.
    pub copies: u64,
    /// Bytes those copies cover.
    pub bytes: u64,
    /// Whether admission is fenced on it after a failed destroy.
    pub fenced: bool,
}

/// A snapshot of the registry's counters, for `engine.describe()`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RegistryCounters {
    /// Live registrations (published or retiring; unquiesced ones excluded).
    pub registrations: u64,
    /// Registrations unpublished but waiting for leases.
    pub retiring: u64,
    /// Native copies charged (existing, being made, or held by unquiesced registrations).
    pub copies: u64,
    /// Bytes charged (each native copy charges its range's length).
    pub bytes: u64,
    /// Bytes of the live registrations, each range once, however many copies it has.
    pub view_bytes: u64,
    /// The budgets.
    pub budgets: Budgets,
    /// Per-context native copies, in context order.
    pub per_context: Vec<ContextCounters>,
    /// Registrations held because a native destroy failed.
    pub unquiesced: u64,
    /// Admissions refused by a budget since start.
    pub exhausted: u64,
    /// Admissions that failed in a native call since start.
    pub register_failures: u64,
}

/// Evidence kept for a registration whose native destroy failed.
#[derive(Clone, Debug)]
pub struct UnquiescedInfo {
    /// The registration's token (no longer visible to peers).
    pub token: SegmentToken,
    /// Its name.
    pub name: String,
    /// The context the destroy failed on.
    pub context: ContextId,
    /// That context's name.
    pub context_name: String,
    /// Native copies still held.
    pub copies_held: usize,
    /// Bytes still charged for them.
    pub bytes_held: u64,
    /// The native error.
    pub error: Arc<NativeError>,
}

/// What [`Registry::retry_unquiesced`] achieved.
#[derive(Clone, Debug)]
pub struct UnquiescedRetry {
    /// Registrations whose every native copy is destroyed now.
    pub released: usize,
    /// Evidence for those still held (with the latest failure).
    pub still_held: Vec<UnquiescedInfo>,
}

struct UnquiescedEntry {
    info: UnquiescedInfo,
    /// The copies that could not be destroyed (kept, never reused).
    _copies: Vec<NativeCopy>,
    /// The memory stays alive as long as native copies may still reference it.
    _region: Arc<MemoryRegion>,
}

#[derive(Default)]
struct Accounts {
    held_copies: u64,
    held_bytes: u64,
    registrations: u64,
    /// Bytes of the live registrations, each range once.
    view_bytes: u64,
    retiring: u64,
    exhausted: u64,
    register_failures: u64,
    per_context: BTreeMap<ContextId, ContextCounters>,
    fenced: BTreeMap<ContextId, Arc<NativeError>>,
    unquiesced: Vec<UnquiescedEntry>,
    errors: Vec<RegistryError>,
}

impl Accounts {
    fn add_copies(&mut self, contexts: &[ContextInfo], copies: &[NativeCopy], len: u64) {
        for copy in copies {
            let entry = self
                .per_context
                .entry(copy.context)
                .or_insert_with(|| ContextCounters {
                    id: copy.context,
                    name: context_name(contexts, copy.context),
                    copies: 0,
                    bytes: 0,
                    fenced: false,
                });
            entry.copies += 1;
            entry.bytes = entry.bytes.saturating_add(len);
        }
    }

    fn remove_copies(&mut self, copies: &[NativeCopy], len: u64) {
        for copy in copies {
            if let Some(entry) = self.per_context.get_mut(&copy.context) {
                entry.copies = entry.copies.saturating_sub(1);
                entry.bytes = entry.bytes.saturating_sub(len);
            }
        }
    }

    fn release_charge(&mut self, copies: u64, len: u64) {
        self.held_copies = self.held_copies.saturating_sub(copies);
        self.held_bytes = self.held_bytes.saturating_sub(copies.saturating_mul(len));
    }

    fn fence(&mut self, contexts: &[ContextInfo], context: ContextId, error: &Arc<NativeError>) {
        self.fenced.entry(context).or_insert_with(|| error.clone());
        let entry = self
            .per_context
            .entry(context)
            .or_insert_with(|| ContextCounters {
                id: context,
                name: context_name(contexts, context),
                copies: 0,
                bytes: 0,
                fenced: true,
            });
        entry.fenced = true;
    }
}

fn context_name(contexts: &[ContextInfo], id: ContextId) -> String {
    contexts
        .iter()
        .find(|c| c.id == id)
        .map_or_else(|| id.to_string(), |c| c.name.clone())
}

struct Shared {
    backend: Arc<dyn RegistrationBackend>,
    budgets: Budgets,
    /// Published, remotely accessible segments: the lookup path (a read lock and a hash lookup).
    published: RwLock<HashMap<SegmentToken, Lease>>,
    accounts: Mutex<Accounts>,
}

impl Shared {
    fn accounts(&self) -> MutexGuard<'_, Accounts> {
        self.accounts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Destroys `copies` in reverse order. Returns the copies left (the failed one last) and the
    /// error, or an empty vector.
    fn destroy_reverse(
        &self,
        mut copies: Vec<NativeCopy>,
    ) -> (
        Vec<NativeCopy>,
        Vec<NativeCopy>,
        Option<(ContextId, NativeError)>,
    ) {
        let mut destroyed = Vec::with_capacity(copies.len());
        while let Some(copy) = copies.pop() {
            match self.backend.destroy_copy(copy.context, copy.handle) {
                Ok(()) => destroyed.push(copy),
                Err(e) => {
                    copies.push(copy);
                    return (destroyed, copies, Some((copy.context, e)));
                }
            }
        }
        (destroyed, copies, None)
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("backend", &self.backend)
            .field("budgets", &self.budgets)
            .finish_non_exhaustive()
    }
}

/// The registry of host memory ranges: admission, fan-out, publication and retirement.
///
/// Cheap to clone (an `Arc`); `Send + Sync`, shared by the API and every transport's server side.
/// It has no threads and never sleeps: native calls run on the caller's thread (retirement on the
/// thread that drops the last reference).
#[derive(Clone, Debug)]
pub struct Registry {
    shared: Arc<Shared>,
}

impl Registry {
    /// A registry over `backend` with `budgets`.
    pub fn new(backend: Arc<dyn RegistrationBackend>, budgets: Budgets) -> Self {
        Self {
            shared: Arc::new(Shared {
                backend,
                budgets,
                published: RwLock::new(HashMap::new()),
                accounts: Mutex::new(Accounts::default()),
            }),
        }
    }

    /// A registry over the [`HostBackend`](crate::HostBackend) (TCP and io_uring).
    pub fn host(budgets: Budgets) -> Self {
        Self::new(Arc::new(crate::backend::HostBackend), budgets)
    }

    /// The backend's contexts, as it lists them now.
    pub fn contexts(&self) -> Vec<ContextInfo> {
        self.shared.backend.contexts()
    }

    /// The budgets this registry enforces.
    pub fn budgets(&self) -> Budgets {
        self.shared.budgets
    }

    /// Admits `region` with `access` against the budgets, makes its native copies on every context
    /// of the backend (paused ones included: one copy per context for a local-only range, two for
    /// a remotely accessible one), then publishes it.
    ///
    /// The whole fan-out is charged before the first native call. If copy `k` fails, copies
    /// `k-1..=0` are destroyed in that order, their charges released, and the native error is
    /// returned naming the context. Published registrations are never evicted to make room.
    pub fn register(
        &self,
        name: impl Into<String>,
        region: Arc<MemoryRegion>,
        access: Access,
    ) -> Result<Registration, RegistryError> {
        self.register_inner(name.into(), region, access, None)
    }

    /// As [`register`](Self::register), on the backend's contexts in `only` alone (GPU memory:
    /// the NICs nearest its GPU). Ids the backend does not list are ignored; if none is left
    /// the error is [`RegistryError::NoContexts`].
    pub fn register_on(
        &self,
        name: impl Into<String>,
        region: Arc<MemoryRegion>,
        access: Access,
        only: &[ContextId],
    ) -> Result<Registration, RegistryError> {
        self.register_inner(name.into(), region, access, Some(only))
    }

    fn register_inner(
        &self,
        name: String,
        region: Arc<MemoryRegion>,
        access: Access,
        only: Option<&[ContextId]>,
    ) -> Result<Registration, RegistryError> {
        let shared = &self.shared;
        let len = region.len() as u64;
        let mut contexts = shared.backend.contexts();
        if let Some(only) = only {
            contexts.retain(|c| only.contains(&c.id));
        }
        if contexts.is_empty() {
            return Err(RegistryError::NoContexts {
                name,
                backend: format!("{:?}", shared.backend),
            });
        }
        let mut plan = Vec::with_capacity(contexts.len() * 2);
        for ctx in &contexts {
            plan.push((ctx.id, CopyRole::Local, Access::LOCAL));
            if access.is_remote() {
                plan.push((ctx.id, CopyRole::Remote, access));
            }
        }
        let requested_copies = plan.len() as u64;
        let requested_bytes = requested_copies.checked_mul(len);

        // Admission: the whole fan-out, before any native call.
        {
            let mut acc = shared.accounts();
            for ctx in &contexts {
                if let Some(cause) = acc.fenced.get(&ctx.id) {
                    return Err(RegistryError::Fenced {
                        name,
                        context: ctx.id,
                        context_name: ctx.name.clone(),
                        cause: cause.clone(),
                    });
                }
            }
            let exhausted = |acc: &mut Accounts, budget, limit| {
                acc.exhausted += 1;
                RegistryError::ResourceExhausted {
                    budget,
                    name: name.clone(),
                    len,
                    requested_copies,
                    requested_bytes: requested_bytes.unwrap_or(u64::MAX),
                    held_copies: acc.held_copies,
                    held_bytes: acc.held_bytes,
                    limit,
                }
            };
            let budgets = shared.budgets;
            let copies_ok = acc
                .held_copies
                .checked_add(requested_copies)
                .is_some_and(|n| n <= budgets.max_copies);
            if !copies_ok {
                return Err(exhausted(&mut acc, Budget::Count, budgets.max_copies));
            }
            let new_bytes = requested_bytes.and_then(|b| acc.held_bytes.checked_add(b));
            let Some(new_bytes) = new_bytes.filter(|&b| b <= budgets.max_bytes) else {
                return Err(exhausted(&mut acc, Budget::Bytes, budgets.max_bytes));
            };
            acc.held_copies += requested_copies;
            acc.held_bytes = new_bytes;
        }

        // Native copies, outside the lock.
        let mut token = SegmentToken::random();
        let mut made: Vec<NativeCopy> = Vec::with_capacity(plan.len());
        for (k, &(context, role, copy_access)) in plan.iter().enumerate() {
            match shared.backend.register_copy(context, &region, copy_access) {
                Ok(handle) => made.push(NativeCopy {
                    context,
                    role,
                    access: copy_access,
                    handle,
                }),
                Err(source) => {
                    tracing::warn!(
                        name = %name, context = %context_name(&contexts, context), copy = k,
                        error = %source, "native registration failed; releasing earlier copies"
                    );
                    self.roll_back(&name, token, &contexts, &region, made, requested_copies);
                    shared.accounts().register_failures += 1;
                    return Err(RegistryError::Register {
                        name,
                        len,
                        access: copy_access,
                        context,
                        context_name: context_name(&contexts, context),
                        copy: k,
                        copies: plan.len(),
                        source,
                    });
                }
            }
        }

        // Publication: every copy exists.
        {
            let mut acc = shared.accounts();
            acc.add_copies(&contexts, &made, len);
            acc.registrations += 1;
            acc.view_bytes = acc.view_bytes.saturating_add(len);
        }
        let mut map = shared
            .published
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        while map.contains_key(&token) {
            token = SegmentToken::random();
        }
        let segment = Arc::new(Segment {
            token,
            name,
            access,
            len,
            copies: made,
            contexts,
            state: AtomicU8::new(SegmentState::Published.as_u8()),
            shared: shared.clone(),
            region,
        });
        let lease = Lease(segment);
        if access.is_remote() {
            map.insert(token, lease.clone());
        }
        drop(map);
        tracing::debug!(token = %token, name = %lease.name(), len, %access, copies = requested_copies, "registration published");
        Ok(Registration {
            lease,
            retired: false,
        })
    }

    /// Destroys the copies made so far of a failed admission, in reverse order, and releases the
    /// charges of the whole fan-out except copies that could not be destroyed.
    fn roll_back(
        &self,
        name: &str,
        token: SegmentToken,
        contexts: &[ContextInfo],
        region: &Arc<MemoryRegion>,
        made: Vec<NativeCopy>,
        charged: u64,
    ) {
        let len = region.len() as u64;
        let (_destroyed, left, failure) = self.shared.destroy_reverse(made);
        let mut acc = self.shared.accounts();
        acc.release_charge(charged - left.len() as u64, len);
        if let Some((context, error)) = failure {
            let error = Arc::new(error);
            let context_name = context_name(contexts, context);
            tracing::error!(name, context = %context_name, error = %error, "native destroy failed while rolling back; copies stay held");
            acc.add_copies(contexts, &left, len);
            acc.fence(contexts, context, &error);
            let info = UnquiescedInfo {
                token,
                name: name.to_owned(),
                context,
                context_name,
                copies_held: left.len(),
                bytes_held: (left.len() as u64).saturating_mul(len),
                error,
            };
            acc.errors.push(unquiesced_error(&info));
            acc.unquiesced.push(UnquiescedEntry {
                info,
                _copies: left,
                _region: region.clone(),
            });
        }
    }

    /// The published, remotely accessible segment under `token`. An unknown token and a retiring
    /// or retired one both give `None`. Local-only ranges are never visible here.
    pub fn lookup(&self, token: SegmentToken) -> Option<Lease> {
        self.shared
            .published
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&token)
            .cloned()
    }

    /// The published, remotely accessible segments (for the handshake).
    pub fn published(&self) -> Vec<Lease> {
        self.shared
            .published
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> RegistryCounters {
        let acc = self.shared.accounts();
        RegistryCounters {
            registrations: acc.registrations,
            retiring: acc.retiring,
            copies: acc.held_copies,
            bytes: acc.held_bytes,
            view_bytes: acc.view_bytes,
            budgets: self.shared.budgets,
            per_context: acc.per_context.values().cloned().collect(),
            unquiesced: acc.unquiesced.len() as u64,
            exhausted: acc.exhausted,
            register_failures: acc.register_failures,
        }
    }

    /// Evidence for every registration held because a native destroy failed.
    pub fn unquiesced(&self) -> Vec<UnquiescedInfo> {
        self.shared
            .accounts()
            .unquiesced
            .iter()
            .map(|e| e.info.clone())
            .collect()
    }

    /// Retries the native destroy of every unquiesced registration, for an operator who dealt
    /// with the cause (a device reset, a process that held the MR). Each copy destroyed now
    /// releases its charge; a registration whose copies are all gone is dropped (its memory is
    /// freed once nothing else holds it); a context is unfenced once no unquiesced registration
    /// is left on it. Native calls run on this thread without the registry's lock held.
    pub fn retry_unquiesced(&self) -> UnquiescedRetry {
        let entries = std::mem::take(&mut self.shared.accounts().unquiesced);
        let mut released = 0usize;
        let mut kept = Vec::new();
        let mut newly_fenced = Vec::new();
        let mut freed_copies = Vec::new();
        for entry in entries {
            let UnquiescedEntry {
                mut info,
                _copies: copies,
                _region: region,
            } = entry;
            let len = region.len() as u64;
            let (destroyed, left, failure) = self.shared.destroy_reverse(copies);
            freed_copies.push((destroyed, len));
            match failure {
                None => {
                    released += 1;
                    tracing::info!(token = %info.token, name = %info.name, "unquiesced registration destroyed on retry");
                }
                Some((context, error)) => {
                    let error = Arc::new(error);
                    info.context = context;
                    info.copies_held = left.len();
                    info.bytes_held = (left.len() as u64).saturating_mul(len);
                    info.error = error.clone();
                    tracing::warn!(token = %info.token, name = %info.name, context = %info.context_name,
                        error = %error, copies_held = left.len(), "native destroy failed again");
                    newly_fenced.push((context, error));
                    kept.push(UnquiescedEntry {
                        info,
                        _copies: left,
                        _region: region,
                    });
                }
            }
        }
        let mut acc = self.shared.accounts();
        for (destroyed, len) in &freed_copies {
            acc.release_charge(destroyed.len() as u64, *len);
            acc.remove_copies(destroyed, *len);
        }
        // Entries recorded meanwhile (a drop on another thread) stay, after the retried ones.
        let recorded_meanwhile = std::mem::take(&mut acc.unquiesced);
        acc.unquiesced = kept;
        acc.unquiesced.extend(recorded_meanwhile);
        for (context, error) in newly_fenced {
            acc.fenced.insert(context, error);
        }
        let still: std::collections::BTreeSet<ContextId> =
            acc.unquiesced.iter().map(|e| e.info.context).collect();
        acc.fenced.retain(|ctx, _| still.contains(ctx));
        let fenced: Vec<ContextId> = acc.fenced.keys().copied().collect();
        for c in acc.per_context.values_mut() {
            c.fenced = fenced.contains(&c.id);
        }
        UnquiescedRetry {
            released,
            still_held: acc.unquiesced.iter().map(|e| e.info.clone()).collect(),
        }
    }

    /// The contexts on which admission is fenced, with the destroy failure that fenced each.
    pub fn fenced(&self) -> Vec<(ContextId, Arc<NativeError>)> {
        self.shared
            .accounts()
            .fenced
            .iter()
            .map(|(id, e)| (*id, e.clone()))
            .collect()
    }

    /// Takes the oldest error recorded where it could not be returned (a drop, a deferred
    /// retirement, a rollback), if any.
    pub fn check(&self) -> Result<(), RegistryError> {
        let mut acc = self.shared.accounts();
        if acc.errors.is_empty() {
            Ok(())
        } else {
            Err(acc.errors.remove(0))
        }
    }

    /// Takes every error recorded where it could not be returned, oldest first.
    pub fn take_errors(&self) -> Vec<RegistryError> {
        std::mem::take(&mut self.shared.accounts().errors)
    }
}

fn unquiesced_error(info: &UnquiescedInfo) -> RegistryError {
    RegistryError::Unquiesced {
        name: info.name.clone(),
        token: info.token,
        context: info.context,
        context_name: info.context_name.clone(),
        copies_held: info.copies_held,
        source: info.error.clone(),
    }
}

struct Segment {
    token: SegmentToken,
    name: String,
    access: Access,
    len: u64,
    /// Emptied by [`Segment::destroy`].
    copies: Vec<NativeCopy>,
    contexts: Vec<ContextInfo>,
    state: AtomicU8,
    shared: Arc<Shared>,
    /// Last field: the memory outlives the native copies that reference it.
    region: Arc<MemoryRegion>,
}

impl Segment {
    fn state(&self) -> SegmentState {
        SegmentState::from_u8(self.state.load(Ordering::Acquire))
    }

    fn set_state(&self, state: SegmentState) {
        self.state.store(state.as_u8(), Ordering::Release);
    }

    /// Destroys the native copies in reverse order (only once no lease is left).
    fn destroy(&mut self) -> Result<(), RegistryError> {
        let copies = std::mem::take(&mut self.copies);
        if copies.is_empty() {
            // Already destroyed (or held as unquiesced evidence).
            return Ok(());
        }
        let shared = self.shared.clone();
        let (destroyed, left, failure) = shared.destroy_reverse(copies);
        let mut acc = shared.accounts();
        acc.release_charge(destroyed.len() as u64, self.len);
        acc.remove_copies(&destroyed, self.len);
        acc.registrations = acc.registrations.saturating_sub(1);
        acc.view_bytes = acc.view_bytes.saturating_sub(self.len);
        acc.retiring = acc.retiring.saturating_sub(1);
        match failure {
            None => {
                self.set_state(SegmentState::Retired);
                tracing::debug!(token = %self.token, name = %self.name, "registration retired");
                Ok(())
            }
            Some((context, error)) => {
                self.set_state(SegmentState::Unquiesced);
                let error = Arc::new(error);
                acc.fence(&self.contexts, context, &error);
                let info = UnquiescedInfo {
                    token: self.token,
                    name: self.name.clone(),
                    context,
                    context_name: context_name(&self.contexts, context),
                    copies_held: left.len(),
                    bytes_held: (left.len() as u64).saturating_mul(self.len),
                    error,
                };
                tracing::error!(
                    token = %self.token, name = %self.name, context = %info.context_name,
                    error = %info.error, copies_held = left.len(),
                    "native destroy failed; registration unquiesced, admission fenced on the context"
                );
                let err = unquiesced_error(&info);
                acc.unquiesced.push(UnquiescedEntry {
                    info,
                    _copies: left,
                    _region: self.region.clone(),
                });
                Err(err)
            }
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            self.shared.accounts().errors.push(e);
        }
    }
}

/// A reference to a published segment, taken by [`Registry::lookup`] or [`Registration::lease`].
/// While any lease lives, the memory and its native copies stay; retiring only unpublishes.
/// Cloning is an `Arc` clone.
#[derive(Clone)]
pub struct Lease(Arc<Segment>);

impl Lease {
    /// The segment's token.
    pub fn token(&self) -> SegmentToken {
        self.0.token
    }

    /// The registration's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.0.access
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The memory.
    pub fn region(&self) -> &Arc<MemoryRegion> {
        &self.0.region
    }

    /// Every native copy, in fan-out order (per context: local, then remote).
    pub fn copies(&self) -> &[NativeCopy] {
        &self.0.copies
    }

    /// The contexts the copies were made on, as the backend listed them at admission.
    pub fn contexts(&self) -> &[ContextInfo] {
        &self.0.contexts
    }

    /// The local key of the local copy on `context`.
    pub fn local_key(&self, context: ContextId) -> Option<u32> {
        self.copy(context, CopyRole::Local).map(|c| c.handle.lkey)
    }

    /// The remote key of the remote copy on `context` (`None` for a local-only range).
    pub fn remote_key(&self, context: ContextId) -> Option<u32> {
        self.copy(context, CopyRole::Remote).map(|c| c.handle.rkey)
    }

    /// The remote keys, one per context, in context order.
    pub fn remote_keys(&self) -> impl Iterator<Item = (ContextId, u32)> + '_ {
        self.0
            .copies
            .iter()
            .filter(|c| c.role == CopyRole::Remote)
            .map(|c| (c.context, c.handle.rkey))
    }

    fn copy(&self, context: ContextId, role: CopyRole) -> Option<&NativeCopy> {
        self.0
            .copies
            .iter()
            .find(|c| c.context == context && c.role == role)
    }

    /// `Published`, or `Retiring` once the registration was retired.
    pub fn state(&self) -> SegmentState {
        self.0.state()
    }

    /// Checks that a peer may do `needed` on `offset..offset+len`: bounds first, then rights.
    pub fn check(&self, offset: u64, len: u64, needed: Access) -> Result<(), AccessError> {
        ferry_core::check_range(offset, len, self.0.len).map_err(|source| {
            AccessError::OutOfBounds {
                token: self.0.token,
                source,
            }
        })?;
        if !self.0.access.contains(needed) {
            return Err(AccessError::Denied {
                token: self.0.token,
                needed,
                granted: self.0.access,
            });
        }
        Ok(())
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("token", &self.0.token)
            .field("name", &self.0.name)
            .field("access", &self.0.access)
            .field("len", &self.0.len)
            .field("state", &self.0.state())
            .finish()
    }
}

/// The owner's handle of a registration. Dropping it retires the registration (errors go to
/// [`Registry::take_errors`]); [`retire`](Self::retire) does the same and reports the result.
#[derive(Debug)]
pub struct Registration {
    lease: Lease,
    retired: bool,
}

impl Registration {
    /// The token peers address it by (visible only for remotely accessible ranges).
    pub fn token(&self) -> SegmentToken {
        self.lease.token()
    }

    /// A lease for local use (the local keys, the memory).
    pub fn lease(&self) -> Lease {
        self.lease.clone()
    }

    /// The registration's name.
    pub fn name(&self) -> &str {
        self.lease.name()
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.lease.access()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.lease.len()
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.lease.is_empty()
    }

    /// The memory.
    pub fn region(&self) -> &Arc<MemoryRegion> {
        self.lease.region()
    }

    /// Always `Published` while the handle lives.
    pub fn state(&self) -> SegmentState {
        self.lease.state()
    }

    /// Unpublishes the range at once (lookup finds it no more), then destroys its native copies in
    /// reverse order if no lease is left, or defers that to the drop of the last lease.
    ///
    /// A failed destroy gives `Unquiesced`: the remaining copies, the memory and their charges stay
    /// held and admission on the context is fenced.
    pub fn retire(mut self) -> Result<Retirement, RegistryError> {
        self.retired = true;
        self.unpublish();
        match Arc::get_mut(&mut self.lease.0) {
            Some(segment) => segment.destroy().map(|()| Retirement::Retired),
            None => Ok(Retirement::Deferred),
        }
    }

    fn unpublish(&self) {
        let segment = &self.lease.0;
        let shared = &segment.shared;
        shared
            .published
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&segment.token);
        segment.set_state(SegmentState::Retiring);
        shared.accounts().retiring += 1;
        tracing::debug!(token = %segment.token, name = %segment.name, "registration retiring");
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if !self.retired {
            self.unpublish();
        }
        // Dropping `self.lease` destroys the copies if it was the last reference; errors are
        // recorded for `Registry::take_errors`.
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::Weak;
    use std::sync::atomic::AtomicUsize;

    use mockall::Sequence;
    use mockall::predicate::{always, eq};

    use super::*;
    use crate::backend::{HostBackend, MockRegistrationBackend};

    const RW: Access = Access::REMOTE_READ.union(Access::REMOTE_WRITE);

    fn contexts(n: u32, paused: &[u32]) -> Vec<ContextInfo> {
        (0..n)
            .map(|i| ContextInfo {
                id: ContextId(i),
                name: format!("mlx5_{i}:1"),
                paused: paused.contains(&i),
            })
            .collect()
    }

    fn mock(n: u32) -> MockRegistrationBackend {
        let mut m = MockRegistrationBackend::new();
        m.expect_contexts().return_const(contexts(n, &[]));
        m
    }

    fn native_err(device: &str, call: &'static str) -> NativeError {
        NativeError::new(device, call, io::Error::from_raw_os_error(12))
    }

    fn region(len: usize) -> Arc<MemoryRegion> {
        Arc::new(MemoryRegion::from_vec(vec![7; len]))
    }

    /// A registry whose backend hands out handles with id = call number, lkey = 100 + id,
    /// rkey = 200 + id, and counts destroys.
    fn counting(n: u32, budgets: Budgets) -> (Registry, Arc<AtomicUsize>) {
        let mut m = mock(n);
        let next = Arc::new(AtomicU64Counter::default());
        m.expect_register_copy().returning(move |_, _, access| {
            let id = next.0.fetch_add(1, Ordering::SeqCst);
            Ok(NativeHandle {
                id,
                lkey: 100 + id as u32,
                rkey: if access.is_remote() {
                    200 + id as u32
                } else {
                    0
                },
            })
        });
        let destroyed = Arc::new(AtomicUsize::new(0));
        let d = destroyed.clone();
        m.expect_destroy_copy().returning(move |_, _| {
            d.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        (Registry::new(Arc::new(m), budgets), destroyed)
    }

    #[derive(Default)]
    struct AtomicU64Counter(std::sync::atomic::AtomicU64);

    #[test]
    fn registry_is_send_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Registry>();
        assert_send_sync::<Lease>();
        assert_send_sync::<Registration>();
    }

    /// `register_on` makes copies on the named contexts only (GPU memory on the NICs nearest its
    /// GPU), charges only those, and refuses a list naming no context the backend has.
    #[test]
    fn register_on_fans_out_to_the_named_contexts_only() {
        let mut m = mock(3);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        m.expect_register_copy().returning(move |ctx, _, access| {
            s.lock().unwrap().push(ctx);
            Ok(NativeHandle {
                id: 1,
                lkey: 1,
                rkey: u32::from(access.is_remote()),
            })
        });
        m.expect_destroy_copy().returning(|_, _| Ok(()));
        let reg = Registry::new(Arc::new(m), Budgets::default());
        let r = reg
            .register_on("gpu", region(64), RW, &[ContextId(2), ContextId(9)])
            .unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![ContextId(2), ContextId(2)]);
        assert_eq!(
            r.lease().remote_keys().map(|(c, _)| c).collect::<Vec<_>>(),
            vec![ContextId(2)]
        );
        assert_eq!(reg.counters().copies, 2);
        let e = reg
            .register_on("none", region(64), RW, &[ContextId(9)])
            .unwrap_err();
        assert!(matches!(e, RegistryError::NoContexts { .. }), "{e}");
    }

    #[test]
    fn count_budget_exceeded_makes_no_native_call() {
        let mut m = mock(2);
        m.expect_register_copy().never();
        m.expect_destroy_copy().never();
        let budgets = Budgets {
            max_copies: 3,
            max_bytes: u64::MAX,
        };
        let reg = Registry::new(Arc::new(m), budgets);
        let err = reg.register("big", region(64), RW).unwrap_err();
        match err {
            RegistryError::ResourceExhausted {
                budget,
                requested_copies,
                requested_bytes,
                held_copies,
                held_bytes,
                limit,
                ..
            } => {
                assert_eq!(budget, Budget::Count);
                assert_eq!((requested_copies, requested_bytes), (4, 256));
                assert_eq!((held_copies, held_bytes, limit), (0, 0, 3));
            }
            other => panic!("expected ResourceExhausted, got {other:?}"),
        }
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes, c.exhausted), (0, 0, 1));
    }

    #[test]
    fn byte_budget_exceeded_names_what_is_held_and_evicts_nothing() {
        let mut m = mock(1);
        m.expect_register_copy()
            .times(4)
            .returning(|_, _, _| Ok(NativeHandle::default()));
        m.expect_destroy_copy().times(4).returning(|_, _| Ok(()));
        let len = 1000u64;
        let budgets = Budgets {
            max_copies: 100,
            max_bytes: 5 * len,
        };
        let reg = Registry::new(Arc::new(m), budgets);
        let a = reg.register("a", region(len as usize), RW).unwrap();
        let b = reg.register("b", region(len as usize), RW).unwrap();
        let err = reg.register("c", region(len as usize), RW).unwrap_err();
        match &err {
            RegistryError::ResourceExhausted {
                budget,
                name,
                requested_copies,
                requested_bytes,
                held_copies,
                held_bytes,
                limit,
                ..
            } => {
                assert_eq!(*budget, Budget::Bytes);
                assert_eq!(name, "c");
                assert_eq!((*requested_copies, *requested_bytes), (2, 2 * len));
                assert_eq!((*held_copies, *held_bytes, *limit), (4, 4 * len, 5 * len));
            }
            other => panic!("expected ResourceExhausted, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("registration bytes"), "{text}");
        // Nothing was evicted to make room.
        assert!(reg.lookup(a.token()).is_some());
        assert!(reg.lookup(b.token()).is_some());
        assert_eq!(reg.counters().copies, 4);
    }

    #[test]
    fn failure_at_copy_k_releases_earlier_copies_in_reverse_order() {
        let mut m = mock(3);
        let mut seq = Sequence::new();
        // Fan-out: ctx0 L, ctx0 R, ctx1 L, ctx1 R, ctx2 L (fails), ctx2 R.
        let plan = [(0, Access::LOCAL), (0, RW), (1, Access::LOCAL), (1, RW)];
        for (i, (ctx, access)) in plan.into_iter().enumerate() {
            m.expect_register_copy()
                .with(eq(ContextId(ctx)), always(), eq(access))
                .times(1)
                .in_sequence(&mut seq)
                .returning(move |_, _, _| {
                    Ok(NativeHandle {
                        id: i as u64,
                        lkey: 1,
                        rkey: 2,
                    })
                });
        }
        m.expect_register_copy()
            .with(eq(ContextId(2)), always(), eq(Access::LOCAL))
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Err(native_err("mlx5_2:1", "ibv_reg_mr")));
        for (i, (ctx, _)) in plan.into_iter().enumerate().rev() {
            m.expect_destroy_copy()
                .withf(move |c, h| *c == ContextId(ctx) && h.id == i as u64)
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _| Ok(()));
        }
        let budgets = Budgets {
            max_copies: 6,
            max_bytes: 6 * 100,
        };
        let reg = Registry::new(Arc::new(m), budgets);
        let err = reg.register("r", region(100), RW).unwrap_err();
        match &err {
            RegistryError::Register {
                context,
                context_name,
                copy,
                copies,
                source,
                ..
            } => {
                assert_eq!(*context, ContextId(2));
                assert_eq!(context_name, "mlx5_2:1");
                assert_eq!((*copy, *copies), (4, 6));
                assert_eq!(source.device, "mlx5_2:1");
                assert_eq!(source.source.raw_os_error(), Some(12));
            }
            other => panic!("expected Register, got {other:?}"),
        }
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes, c.registrations), (0, 0, 0));
        assert_eq!(c.register_failures, 1);
        assert!(c.per_context.iter().all(|p| p.copies == 0));
        assert!(reg.take_errors().is_empty());
    }

    #[test]
    fn charges_released_after_failure_admit_the_next_range() {
        let mut m = mock(1);
        let mut seq = Sequence::new();
        m.expect_register_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(NativeHandle::default()));
        m.expect_register_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Err(native_err("mlx5_0:1", "ibv_reg_mr")));
        m.expect_destroy_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _| Ok(()));
        m.expect_register_copy()
            .times(2)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(NativeHandle::default()));
        m.expect_destroy_copy()
            .times(2)
            .in_sequence(&mut seq)
            .returning(|_, _| Ok(()));
        let budgets = Budgets {
            max_copies: 2,
            max_bytes: u64::MAX,
        };
        let reg = Registry::new(Arc::new(m), budgets);
        assert!(matches!(
            reg.register("a", region(8), RW),
            Err(RegistryError::Register { copy: 1, .. })
        ));
        let ok = reg.register("b", region(8), RW).unwrap();
        assert_eq!(reg.counters().copies, 2);
        assert_eq!(ok.retire().unwrap(), Retirement::Retired);
    }

    #[test]
    fn remote_ranges_get_two_copies_per_context_paused_included() {
        let mut m = MockRegistrationBackend::new();
        m.expect_contexts().return_const(contexts(2, &[1]));
        let mut seq = Sequence::new();
        let plan = [
            (0, Access::LOCAL, 10, 0),
            (0, Access::REMOTE_READ, 11, 21),
            (1, Access::LOCAL, 12, 0),
            (1, Access::REMOTE_READ, 13, 23),
        ];
        for (ctx, access, lkey, rkey) in plan {
            m.expect_register_copy()
                .with(eq(ContextId(ctx)), always(), eq(access))
                .times(1)
                .in_sequence(&mut seq)
                .returning(move |_, _, _| {
                    Ok(NativeHandle {
                        id: u64::from(lkey),
                        lkey,
                        rkey,
                    })
                });
        }
        // Then a local-only range: one copy per context, paused included.
        for ctx in 0..2 {
            m.expect_register_copy()
                .with(eq(ContextId(ctx)), always(), eq(Access::LOCAL))
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _, _| Ok(NativeHandle::default()));
        }
        m.expect_destroy_copy().times(6).returning(|_, _| Ok(()));
        let reg = Registry::new(Arc::new(m), Budgets::default());
        let remote = reg
            .register("remote", region(4096), Access::REMOTE_READ)
            .unwrap();
        let lease = reg.lookup(remote.token()).unwrap();
        assert_eq!(lease.copies().len(), 4);
        assert_eq!(
            lease.copies().iter().map(|c| c.role).collect::<Vec<_>>(),
            [
                CopyRole::Local,
                CopyRole::Remote,
                CopyRole::Local,
                CopyRole::Remote
            ]
        );
        assert_eq!(lease.remote_key(ContextId(1)), Some(23));
        assert_eq!(lease.local_key(ContextId(1)), Some(12));
        assert_eq!(
            lease.remote_keys().collect::<Vec<_>>(),
            [(ContextId(0), 21), (ContextId(1), 23)]
        );
        assert!(lease.contexts()[1].paused);

        let local = reg.register("local", region(4096), Access::LOCAL).unwrap();
        assert_eq!(local.lease().copies().len(), 2);
        assert_eq!(local.lease().remote_key(ContextId(0)), None);
        // Local-only ranges are never visible to peers.
        assert!(reg.lookup(local.token()).is_none());

        let c = reg.counters();
        assert_eq!((c.registrations, c.copies, c.bytes), (2, 6, 6 * 4096));
        assert_eq!(
            c.per_context
                .iter()
                .map(|p| (p.id, p.copies))
                .collect::<Vec<_>>(),
            [(ContextId(0), 3), (ContextId(1), 3)]
        );
        drop(lease);
        assert_eq!(remote.retire().unwrap(), Retirement::Retired);
        drop(local);
        assert!(reg.take_errors().is_empty());
        assert_eq!(reg.counters().copies, 0);
    }

    #[test]
    fn retire_hides_the_token_while_a_lease_keeps_memory_alive() {
        let (reg, destroyed) = counting(1, Budgets::default());
        let mem = region(64);
        let weak: Weak<MemoryRegion> = Arc::downgrade(&mem);
        let r = reg.register("seg", mem, RW).unwrap();
        let token = r.token();
        let lease = reg.lookup(token).unwrap();
        assert_eq!(lease.state(), SegmentState::Published);

        assert_eq!(r.retire().unwrap(), Retirement::Deferred);
        assert!(reg.lookup(token).is_none());
        assert_eq!(lease.state(), SegmentState::Retiring);
        assert_eq!(destroyed.load(Ordering::SeqCst), 0);
        let c = reg.counters();
        assert_eq!((c.copies, c.retiring, c.registrations), (2, 1, 1));
        // The in-flight user still reads the memory.
        let mut buf = [0u8; 4];
        lease.region().write_at(60, b"abcd").unwrap();
        lease.region().read_at(60, &mut buf).unwrap();
        assert_eq!(&buf, b"abcd");
        assert!(weak.upgrade().is_some());

        drop(lease);
        assert_eq!(destroyed.load(Ordering::SeqCst), 2);
        assert!(weak.upgrade().is_none());
        let c = reg.counters();
        assert_eq!(
            (c.copies, c.bytes, c.retiring, c.registrations),
            (0, 0, 0, 0)
        );
        assert!(reg.check().is_ok());
    }

    #[test]
    fn unknown_and_retired_tokens_look_the_same() {
        let reg = Registry::host(Budgets::default());
        assert_eq!(
            reg.contexts(),
            [ContextInfo::new(HostBackend::CONTEXT, "host")]
        );
        let kept = reg.register("kept", region(16), RW).unwrap();
        let gone = reg.register("gone", region(16), RW).unwrap();
        let retired = gone.token();
        assert!(reg.lookup(retired).is_some());
        assert_eq!(gone.retire().unwrap(), Retirement::Retired);
        let unknown = loop {
            let t = SegmentToken::random();
            if t != kept.token() && t != retired {
                break t;
            }
        };
        assert!(reg.lookup(retired).is_none());
        assert!(reg.lookup(unknown).is_none());
        assert!(reg.lookup(kept.token()).is_some());
        assert_eq!(reg.published().len(), 1);
    }

    #[test]
    fn drop_retires_like_retire() {
        let reg = Registry::new(Arc::new(HostBackend), Budgets::default());
        let r = reg.register("d", region(16), Access::REMOTE_WRITE).unwrap();
        let token = r.token();
        assert_eq!(reg.counters().copies, 2);
        drop(r);
        assert!(reg.lookup(token).is_none());
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes, c.registrations), (0, 0, 0));
    }

    fn failing_destroy_backend() -> MockRegistrationBackend {
        // Two contexts, remote: copies 0..4; destroy order 3, 2 (fails on ctx1's local copy).
        let mut m = mock(2);
        let next = Arc::new(AtomicU64Counter::default());
        m.expect_register_copy().times(4).returning(move |_, _, _| {
            Ok(NativeHandle {
                id: next.0.fetch_add(1, Ordering::SeqCst),
                lkey: 0,
                rkey: 0,
            })
        });
        let mut seq = Sequence::new();
        m.expect_destroy_copy()
            .withf(|c, h| *c == ContextId(1) && h.id == 3)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _| Ok(()));
        m.expect_destroy_copy()
            .withf(|c, h| *c == ContextId(1) && h.id == 2)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _| Err(native_err("mlx5_1:1", "ibv_dereg_mr")));
        m
    }

    fn assert_unquiesced_state(reg: &Registry, weak: &Weak<MemoryRegion>, len: u64) {
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes), (3, 3 * len), "charges stay held");
        assert_eq!((c.unquiesced, c.registrations, c.retiring), (1, 0, 0));
        let per: Vec<_> = c
            .per_context
            .iter()
            .map(|p| (p.id, p.copies, p.fenced))
            .collect();
        assert_eq!(per, [(ContextId(0), 2, false), (ContextId(1), 1, true)]);
        assert!(weak.upgrade().is_some(), "memory stays alive");
        let evidence = reg.unquiesced();
        assert_eq!(evidence.len(), 1);
        assert_eq!(evidence[0].context, ContextId(1));
        assert_eq!(evidence[0].context_name, "mlx5_1:1");
        assert_eq!(evidence[0].copies_held, 3);
        assert_eq!(evidence[0].error.call, "ibv_dereg_mr");
        assert_eq!(reg.fenced().len(), 1);
        // New admission is fenced, before any native call (the mock allows no more registers).
        match reg.register("next", region(8), Access::LOCAL) {
            Err(RegistryError::Fenced {
                context,
                context_name,
                cause,
                ..
            }) => {
                assert_eq!(context, ContextId(1));
                assert_eq!(context_name, "mlx5_1:1");
                assert_eq!(cause.device, "mlx5_1:1");
            }
            other => panic!("expected Fenced, got {other:?}"),
        }
    }

    #[test]
    fn destroy_failure_is_unquiesced_keeps_charges_and_fences_admission() {
        let reg = Registry::new(Arc::new(failing_destroy_backend()), Budgets::default());
        let mem = region(100);
        let weak = Arc::downgrade(&mem);
        let r = reg.register("u", mem, RW).unwrap();
        let token = r.token();
        match r.retire() {
            Err(RegistryError::Unquiesced {
                token: t,
                context,
                copies_held,
                source,
                ..
            }) => {
                assert_eq!(t, token);
                assert_eq!(context, ContextId(1));
                assert_eq!(copies_held, 3);
                assert_eq!(source.source.raw_os_error(), Some(12));
            }
            other => panic!("expected Unquiesced, got {other:?}"),
        }
        assert!(reg.lookup(token).is_none());
        assert_unquiesced_state(&reg, &weak, 100);
        // Returned directly, so not recorded a second time.
        assert!(reg.take_errors().is_empty());
    }

    #[test]
    fn retry_unquiesced_releases_charges_and_unfences_once_destroys_succeed() {
        let mut m = failing_destroy_backend();
        // The retry: copy 2 fails once more, then 2, 1, 0 go.
        let mut seq = Sequence::new();
        m.expect_destroy_copy()
            .withf(|c, h| *c == ContextId(1) && h.id == 2)
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _| Err(native_err("mlx5_1:1", "ibv_dereg_mr")));
        for id in [2u64, 1, 0] {
            m.expect_destroy_copy()
                .withf(move |_, h| h.id == id)
                .times(1)
                .in_sequence(&mut seq)
                .returning(|_, _| Ok(()));
        }
        let reg = Registry::new(Arc::new(m), Budgets::default());
        let mem = region(100);
        let weak = Arc::downgrade(&mem);
        let r = reg.register("u", mem, RW).unwrap();
        assert!(r.retire().is_err());
        let first = reg.retry_unquiesced();
        assert_eq!(first.released, 0);
        assert_eq!(first.still_held.len(), 1);
        assert_eq!(first.still_held[0].copies_held, 3);
        assert_unquiesced_state(&reg, &weak, 100);
        let second = reg.retry_unquiesced();
        assert_eq!((second.released, second.still_held.len()), (1, 0));
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes, c.unquiesced), (0, 0, 0));
        assert!(
            c.per_context.iter().all(|p| p.copies == 0 && !p.fenced),
            "{c:?}"
        );
        assert!(reg.fenced().is_empty());
        assert!(weak.upgrade().is_none(), "memory freed with the last copy");
        assert!(
            reg.take_errors().is_empty(),
            "retire returned its error directly"
        );
    }

    #[test]
    fn destroy_failure_on_drop_is_recorded_not_panicked() {
        let reg = Registry::new(Arc::new(failing_destroy_backend()), Budgets::default());
        let mem = region(100);
        let weak = Arc::downgrade(&mem);
        let r = reg.register("u", mem, RW).unwrap();
        let lease = reg.lookup(r.token()).unwrap();
        drop(r);
        assert!(reg.check().is_ok(), "nothing destroyed while a lease lives");
        drop(lease); // the last lease destroys, on this thread
        assert!(matches!(
            reg.check(),
            Err(RegistryError::Unquiesced { copies_held: 3, .. })
        ));
        assert!(reg.check().is_ok());
        assert_unquiesced_state(&reg, &weak, 100);
    }

    #[test]
    fn rollback_destroy_failure_is_unquiesced_too() {
        let mut m = mock(1);
        let mut seq = Sequence::new();
        m.expect_register_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Ok(NativeHandle::default()));
        m.expect_register_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _, _| Err(native_err("mlx5_0:1", "ibv_reg_mr")));
        m.expect_destroy_copy()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_, _| Err(native_err("mlx5_0:1", "ibv_dereg_mr")));
        let reg = Registry::new(Arc::new(m), Budgets::default());
        assert!(matches!(
            reg.register("x", region(10), RW),
            Err(RegistryError::Register { copy: 1, .. })
        ));
        let c = reg.counters();
        assert_eq!((c.copies, c.bytes, c.unquiesced), (1, 10, 1));
        assert!(matches!(
            reg.take_errors().as_slice(),
            [RegistryError::Unquiesced { copies_held: 1, .. }]
        ));
        assert!(matches!(
            reg.register("y", region(10), RW),
            Err(RegistryError::Fenced { .. })
        ));
    }

    #[test]
    fn lease_check_separates_bounds_from_access() {
        let reg = Registry::new(Arc::new(HostBackend), Budgets::default());
        let r = reg
            .register("ro", region(100), Access::REMOTE_READ)
            .unwrap();
        let lease = reg.lookup(r.token()).unwrap();
        assert_eq!(lease.check(0, 100, Access::REMOTE_READ), Ok(()));
        assert_eq!(lease.check(100, 0, Access::REMOTE_READ), Ok(()));
        assert!(matches!(
            lease.check(99, 2, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            lease.check(u64::MAX, 2, Access::REMOTE_READ),
            Err(AccessError::OutOfBounds { .. })
        ));
        assert_eq!(
            lease.check(0, 1, Access::REMOTE_WRITE),
            Err(AccessError::Denied {
                token: r.token(),
                needed: Access::REMOTE_WRITE,
                granted: Access::REMOTE_READ,
            })
        );
    }

    #[test]
    fn no_contexts_is_an_error() {
        let mut m = MockRegistrationBackend::new();
        m.expect_contexts().return_const(Vec::new());
        m.expect_register_copy().never();
        let reg = Registry::new(Arc::new(m), Budgets::default());
        assert!(matches!(
            reg.register("n", region(1), RW),
            Err(RegistryError::NoContexts { .. })
        ));
        assert_eq!(reg.counters().copies, 0);
    }

    #[test]
    fn concurrent_register_lookup_retire_balances() {
        let reg = Registry::new(Arc::new(HostBackend), Budgets::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let reg = reg.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let r = reg.register("t", region(32), RW).unwrap();
                        let lease = reg.lookup(r.token()).unwrap();
                        lease.check(0, 32, Access::REMOTE_WRITE).unwrap();
                        drop(r);
                        assert!(reg.lookup(lease.token()).is_none());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let c = reg.counters();
        assert_eq!(
            (c.copies, c.bytes, c.registrations, c.retiring),
            (0, 0, 0, 0)
        );
        assert!(reg.take_errors().is_empty());
    }
}
