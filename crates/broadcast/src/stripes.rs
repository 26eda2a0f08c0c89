//! A relay plan that scales: `d` stripes of the chunks, each pushed down a tree of degree `d`
//! whose inner members are one `d`-th of the fleet, so that every member uploads about what it
//! downloads, the depth is about `log_d N` instead of `N`, and the source sends each byte once.
//! A pure function of the membership and the observed rates: no I/O, no clock.
//!
//! - Members are ranked by observed rate (fastest first; ties in join order). A member whose
//!   rate is below `straggler` times the median is a *straggler*: a leaf of every tree, so it
//!   slows no one but itself (the edge of the plan).
//! - The others are dealt round-robin into `d` groups. In stripe `s` (the chunks `c` with
//!   `c % d == s`), group `s` forms a `d`-ary heap under the source (its first member the root,
//!   member `i`'s inner children `d*i+1 ..= d*i+d`), and every other member (the other groups'
//!   and the stragglers) is a leaf, hung on the inner member with the fewest children,
//!   shallowest first.
//! - So each non-straggler is inner in one stripe (serving about `d` children a `1/d` share of
//!   the chunks: about one payload) and a leaf in the others; the source serves the `d` roots,
//!   a `1/d` share each: one payload.
//!
//! [`StripePlan::parent`] answers "whom does member `m` fetch chunk `c` from": the same answer
//! for every member computing it from the same list, so no coordinator is needed.
//! [`Receiver`](crate::Receiver) follows [`StripePlan::numbered`] (groups dealt by a stable
//! number per member, so a departure moves only its children; through
//! [`plan::stripe_holders`](crate::plan::stripe_holders)), and [`StripePlan::in_join_order`]
//! for members that carry no numbers; [`sim`](crate::sim) compares the plans with the chain.

/// Where a member fetches a stripe from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// The source.
    Source,
    /// The member of this index (in the slice the plan was made from).
    Member(usize),
}

#[cfg(test)]
impl Parent {
    /// The same parent in a slice with the first member removed.
    fn shifted_down(self) -> Self {
        match self {
            Parent::Member(p) => Parent::Member(p.saturating_sub(1)),
            p => p,
        }
    }
}

/// How members are dealt into the groups whose trees carry the stripes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ranking {
    /// Fastest first.
    ByRate,
    /// In the order given (join order), stragglers left out.
    JoinOrder,
}

/// The plan for one membership: for each stripe, each member's parent.
#[derive(Clone, Debug)]
pub struct StripePlan {
    d: usize,
    /// `parents[s][m]`.
    parents: Vec<Vec<Parent>>,
    stragglers: Vec<bool>,
}

impl StripePlan {
    /// The plan for members with observed `rates` (bytes/s; any positive scale, `0` or NaN for
    /// a member not measured yet, taken as the median), `d` stripes (at least 1; 1 is a
    /// chain of trees of degree 1, that is a chain in rate order), and stragglers below
    /// `straggler` times the median rate.
    pub fn new(rates: &[f64], d: usize, straggler: f64) -> Self {
        Self::make(rates, d, straggler, &[], Ranking::ByRate)
    }

    /// The plan that receivers follow: as [`new`](Self::new), but the members are dealt into
    /// the groups in the order of the slice (join order), stragglers included, and a straggler
    /// is then taken out of its group's tree (a leaf of every tree). So a member that joins
    /// last, or a rate that changes without crossing the straggler threshold, never moves
    /// anyone else's inner parent: members that list each other at different moments agree on
    /// every tree they are inner in. Members `m` with `edge[m]` (missing: `false`) are taken
    /// as stragglers whatever their rate: a member others gave up on keeps its place in join
    /// order, so giving it up moves only its own children.
    pub fn in_join_order(rates: &[f64], d: usize, straggler: f64, edge: &[bool]) -> Self {
        Self::make(rates, d, straggler, edge, Ranking::JoinOrder)
    }

    /// The plan that receivers follow: members dealt by a stable number each (`numbers`,
    /// distinct, assigned by discovery at join and dense from 0 within a version), so that a
    /// departure moves no one but the departed member's children.
    ///
    /// Number `k` is member of group `k % d` at slot `k / d`. Stripe `s`'s tree is laid out
    /// over every number up to the highest listed, listed or not (a number whose member left,
    /// a straggler, one in `edge`: a *hole*): group `s` forms a `d`-ary heap by slot, and every
    /// other number is a leaf, hung in number order on the inner slot with the fewest children,
    /// shallowest first. A member whose parent in that layout is listed and not a hole keeps
    /// it. Where the layout's root is a hole, the lowest listed non-hole of group `s` fetches
    /// from the source (the *acting root*). Every other member whose parent is a hole (an
    /// *orphan*), in number order, takes the non-hole of group `s` with the fewest children,
    /// then the shallowest, then the lowest number, that is not below it: a balanced tree
    /// has spare places where the layout's rounding left them and where the departed member
    /// was a child, so one departure from a plan without holes moves its children into them
    /// and no one else.
    ///
    /// So: a member whose parent in the layout is listed never moves; from a plan without
    /// holes, a departure changes the parent only of the members whose parent it was (unless
    /// it held the highest number: the leaves of its stripe are then dealt over one number
    /// fewer); a member that joins with a new highest number moves no inner parent. Orphans
    /// of earlier departures are placed again by the children counts of the moment, so with
    /// several holes they may move when another member leaves.
    ///
    /// Numbers not distinct, or sparser than [`MAX_SPAN`] times the members (an older
    /// member that sends none, a discovery that numbers otherwise), fall back to
    /// [`in_join_order`](Self::in_join_order) on the slice's order.
    pub fn numbered(
        numbers: &[u64],
        rates: &[f64],
        d: usize,
        straggler: f64,
        edge: &[bool],
    ) -> Self {
        let n = rates.len();
        let d = d.max(1);
        let span = numbers.iter().max().map_or(0, |&m| m.saturating_add(1));
        let distinct = numbers.len() == n && {
            let mut v = numbers.to_vec();
            v.sort_unstable();
            v.windows(2).all(|w| w[0] != w[1])
        };
        if n == 0 || !distinct || span > (MAX_SPAN * n as u64).saturating_add(MAX_SPAN * d as u64) {
            return Self::in_join_order(rates, d, straggler, edge);
        }
        let span = span as usize;
        let stragglers = straggling(rates, straggler, edge);
        let mut at: Vec<Option<usize>> = vec![None; span];
        for (m, &k) in numbers.iter().enumerate() {
            at[k as usize] = Some(m);
        }
        // Holes: numbers not listed, and stragglers (unless everyone straggles: then the
        // rates are ignored, and if everyone is in `edge` too, nothing is a hole).
        let mut serves: Vec<bool> = (0..n).map(|m| !stragglers[m]).collect();
        if !serves.iter().any(|&s| s) {
            serves = (0..n)
                .map(|m| !edge.get(m).copied().unwrap_or(false))
                .collect();
        }
        if !serves.iter().any(|&s| s) {
            serves = vec![true; n];
        }
        let present = |k: usize| at[k].is_some_and(|m| serves[m]);
        let first = (0..d).find(|&g| (g..span).step_by(d).any(present));
        let mut parents = Vec::with_capacity(d);
        for s in 0..d {
            // A stripe whose group has no member that serves borrows the first group's tree.
            let g = if (s..span).step_by(d).any(present) {
                s
            } else {
                first.unwrap_or(s)
            };
            let up = layout(span, d, g);
            parents.push(realize(&up, numbers, &at, &present, d, g));
        }
        Self {
            d,
            parents,
            stragglers: (0..n).map(|m| !serves[m]).collect(),
        }
    }

    fn make(rates: &[f64], d: usize, straggler: f64, edge: &[bool], ranking: Ranking) -> Self {
        let n = rates.len();
        let d = d.max(1);
        let mut known: Vec<f64> = rates
            .iter()
            .copied()
            .filter(|r| r.is_finite() && *r > 0.0)
            .collect();
        known.sort_by(f64::total_cmp);
        let median = known.get(known.len() / 2).copied().unwrap_or(1.0);
        let rate = |i: usize| {
            let r = rates[i];
            if r.is_finite() && r > 0.0 { r } else { median }
        };
        let stragglers: Vec<bool> = (0..n)
            .map(|i| rate(i) < straggler * median || edge.get(i).copied().unwrap_or(false))
            .collect();
        let by_rate = |v: &mut Vec<usize>| {
            v.sort_by(|&a, &b| rate(b).total_cmp(&rate(a)).then(a.cmp(&b)));
        };
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); d];
        match ranking {
            Ranking::ByRate => {
                let mut ranked: Vec<usize> = (0..n).filter(|&i| !stragglers[i]).collect();
                by_rate(&mut ranked);
                for (k, &m) in ranked.iter().enumerate() {
                    groups[k % d].push(m);
                }
            }
            Ranking::JoinOrder => {
                for m in 0..n {
                    if !stragglers[m] {
                        groups[m % d].push(m);
                    }
                }
            }
        }
        if groups.iter().all(Vec::is_empty) {
            // Everyone straggles: the fastest of them carry the plan anyway.
            let mut ranked: Vec<usize> = (0..n).collect();
            by_rate(&mut ranked);
            for (k, &m) in ranked.iter().enumerate() {
                groups[k % d].push(m);
            }
        }
        let first = groups.iter().position(|g| !g.is_empty()).unwrap_or(0);
        let mut parents = Vec::with_capacity(d);
        for s in 0..d {
            let mut p = vec![Parent::Source; n];
            // A stripe whose group is empty (fewer members than stripes) borrows the first
            // that is not.
            let inner: &[usize] = if groups[s].is_empty() {
                &groups[first]
            } else {
                &groups[s]
            };
            let mut children = vec![0usize; inner.len()];
            let mut depth = vec![0usize; inner.len()];
            for (i, &m) in inner.iter().enumerate() {
                if i > 0 {
                    let up = (i - 1) / d;
                    p[m] = Parent::Member(inner[up]);
                    children[up] += 1;
                    depth[i] = depth[up] + 1;
                }
            }
            let is_inner: std::collections::HashSet<usize> = inner.iter().copied().collect();
            // Leaves: the fastest first (in join order: the first to join first), each on the
            // inner member with the fewest children, shallowest first (stragglers last, so they
            // never take a shallow slot from others).
            let mut leaves: Vec<usize> = (0..n).filter(|m| !is_inner.contains(m)).collect();
            leaves.sort_by(|&a, &b| {
                let faster = match ranking {
                    Ranking::ByRate => rate(b).total_cmp(&rate(a)),
                    Ranking::JoinOrder => std::cmp::Ordering::Equal,
                };
                stragglers[a]
                    .cmp(&stragglers[b])
                    .then(faster)
                    .then(a.cmp(&b))
            });
            for m in leaves {
                if let Some(i) = (0..inner.len()).min_by_key(|&i| (children[i], depth[i], i)) {
                    p[m] = Parent::Member(inner[i]);
                    children[i] += 1;
                }
            }
            parents.push(p);
        }
        Self {
            d,
            parents,
            stragglers,
        }
    }

    /// Stripes (and the degree of each tree).
    pub fn stripes(&self) -> usize {
        self.d
    }

    /// The stripe chunk `c` belongs to.
    pub fn stripe_of(&self, c: usize) -> usize {
        c % self.d
    }

    /// Whom member `m` fetches stripe `s` from.
    pub fn parent(&self, s: usize, m: usize) -> Parent {
        self.parents[s][m]
    }

    /// Whether member `m` was found a straggler (a leaf of every tree).
    pub fn is_straggler(&self, m: usize) -> bool {
        self.stragglers[m]
    }

    /// The members that fetch stripe `s` from `p`.
    pub fn children(&self, s: usize, p: Parent) -> Vec<usize> {
        (0..self.parents[s].len())
            .filter(|&m| self.parents[s][m] == p)
            .collect()
    }

    /// Hops from the source to member `m` in stripe `s` (`None`: a cycle, which a plan never
    /// has).
    pub fn depth(&self, s: usize, m: usize) -> Option<usize> {
        let mut at = m;
        for hops in 1..=self.parents[s].len() {
            match self.parents[s][at] {
                Parent::Source => return Some(hops),
                Parent::Member(p) => at = p,
            }
        }
        None
    }
}

/// How much sparser than the members a plan's numbers may be before
/// [`StripePlan::numbered`] falls back to join order: the numbers up to the highest are laid
/// out, listed or not.
pub const MAX_SPAN: u64 = 4;

/// Whether each member straggles: a rate below `straggler` times the median of the measured
/// rates (`0` or NaN: not measured, taken as the median), or in `edge`.
fn straggling(rates: &[f64], straggler: f64, edge: &[bool]) -> Vec<bool> {
    let mut known: Vec<f64> = rates
        .iter()
        .copied()
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    known.sort_by(f64::total_cmp);
    let median = known.get(known.len() / 2).copied().unwrap_or(1.0);
    rates
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let r = if r.is_finite() && r > 0.0 { r } else { median };
            r < straggler * median || edge.get(i).copied().unwrap_or(false)
        })
        .collect()
}

/// One stripe's parents from its layout `up` (group `g`'s tree over every number): a member
/// whose parent in the layout is `present` keeps it; the lowest present member of group `g`
/// whose ancestors are all holes fetches from the source (the *acting root*); every other
/// member whose parent is a hole (an *orphan*), in number order, takes the present member of
/// group `g` with the fewest children, shallowest, lowest number, that is not below it.
fn realize(
    up: &[Option<usize>],
    numbers: &[u64],
    at: &[Option<usize>],
    present: &impl Fn(usize) -> bool,
    d: usize,
    g: usize,
) -> Vec<Parent> {
    let span = up.len();
    // Parent number per number (`None`: the source, or not placed yet).
    let mut parent: Vec<Option<usize>> = vec![None; span];
    let mut children = vec![0usize; span];
    let mut orphans = Vec::new();
    for &k in numbers {
        let k = k as usize;
        match up[k] {
            Some(q) if present(q) => {
                parent[k] = Some(q);
                children[q] += 1;
            }
            // The layout's root, or one whose parent is a hole.
            None if present(k) => {}
            _ => orphans.push(k),
        }
    }
    let inner: Vec<usize> = (g..span).step_by(d).filter(|&k| present(k)).collect();
    let root_present = present(g) && g < span;
    // The acting root: where the layout's root is a hole, the lowest present member of the
    // group (all its ancestors are holes: they have lower numbers).
    let acting = if root_present {
        None
    } else {
        inner.first().copied()
    };
    let top = if root_present { Some(g) } else { acting };
    // Hops from the source to `k` along `parent`, if that reaches the root (not an orphan
    // still to place, nor `k`'s own subtree).
    let rooted_depth = |parent: &[Option<usize>], mut k: usize| {
        let mut hops = 1;
        for _ in 0..=span {
            match parent[k] {
                Some(q) => {
                    k = q;
                    hops += 1;
                }
                None => return (Some(k) == top).then_some(hops),
            }
        }
        None
    };
    let layout_depth = |mut k: usize| {
        let mut hops = 1;
        while let Some(q) = up[k] {
            k = q;
            hops += 1;
        }
        hops
    };
    // Group `g`'s orphans first (they have children of their own, and places for others),
    // shallowest first, so a place is taken only below members whose depth is final: each
    // orphan ends at most one hop deeper than its place in the layout.
    orphans.sort_unstable_by_key(|&k| (k % d != g, layout_depth(k), k));
    for k in orphans {
        if Some(k) == acting {
            continue;
        }
        let most = layout_depth(k);
        let best = inner
            .iter()
            .copied()
            .filter_map(|y| {
                rooted_depth(&parent, y)
                    .filter(|&depth| depth <= most)
                    .map(|depth| (children[y], depth, y))
            })
            .min();
        // None only without a root (group `g` has no member that serves, which the caller
        // rules out): the source, then.
        if let Some((_, _, y)) = best {
            parent[k] = Some(y);
            children[y] += 1;
        }
    }
    numbers
        .iter()
        .enumerate()
        .map(|(m, &k)| match parent[k as usize] {
            Some(q) => Parent::Member(at[q].unwrap_or(m)),
            None => Parent::Source,
        })
        .collect()
}

/// Stripe `g`'s tree laid out over numbers `0..span`: each number's parent number (`None`:
/// the source). Group `g` (numbers `k % d == g`) is a `d`-ary heap by slot `k / d`; every other
/// number, in order, a leaf on the inner slot with the fewest children, shallowest first.
fn layout(span: usize, d: usize, g: usize) -> Vec<Option<usize>> {
    let inner: Vec<usize> = (g..span).step_by(d).collect();
    let mut up = vec![None; span];
    let mut children = vec![0usize; inner.len()];
    let mut depth = vec![0usize; inner.len()];
    for j in 1..inner.len() {
        let p = (j - 1) / d;
        up[inner[j]] = Some(inner[p]);
        children[p] += 1;
        depth[j] = depth[p] + 1;
    }
    if inner.is_empty() {
        return up;
    }
    // The inner slot with the fewest children, shallowest first, by (children, depth, slot):
    // a heap of candidates, each popped, taken and pushed back with one child more.
    let mut free: std::collections::BinaryHeap<std::cmp::Reverse<(usize, usize, usize)>> = (0
        ..inner.len())
        .map(|j| std::cmp::Reverse((children[j], depth[j], j)))
        .collect();
    for k in (0..span).filter(|k| k % d != g) {
        if let Some(std::cmp::Reverse((c, dep, j))) = free.pop() {
            up[k] = Some(inner[j]);
            free.push(std::cmp::Reverse((c + 1, dep, j)));
        }
    }
    up
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every member gets every stripe down a path from the source (no cycle), within
        /// `log_d` of the non-stragglers plus one hop for a leaf; stragglers serve no one; the
        /// source serves one root per stripe (egress one payload); no non-straggler serves more
        /// than about one payload (its children in its one inner stripe, each a 1/d share).
        #[test]
        fn trees_are_shallow_balanced_and_keep_stragglers_at_the_edge(
            rates in proptest::collection::vec(prop_oneof![4 => 0.5f64..2.0, 1 => 0.01f64..0.2, 1 => Just(0.0)], 1..300),
            d in 1usize..9,
        ) {
            let plan = StripePlan::new(&rates, d, 0.5);
            let n = rates.len();
            let fast = (0..n).filter(|&m| !plan.is_straggler(m)).count();
            let bound = {
                // Depth of a d-ary heap of `per` members, plus the leaf hop.
                let per = fast.max(1).div_ceil(d);
                let mut depth = 1;
                let mut cap = 1usize;
                let mut level = 1usize;
                while cap < per {
                    level = level.saturating_mul(d);
                    cap = cap.saturating_add(level);
                    depth += 1;
                }
                depth + 1
            };
            let mut upload = vec![0usize; n];
            for s in 0..plan.stripes() {
                prop_assert!(plan.children(s, Parent::Source).len() <= 1);
                for m in 0..n {
                    let depth = plan.depth(s, m);
                    prop_assert!(depth.is_some(), "a cycle in stripe {s}");
                    prop_assert!(depth.unwrap_or(0) <= bound.max(1), "member {m} at depth {depth:?} > {bound}");
                    if let Parent::Member(p) = plan.parent(s, m) {
                        prop_assert!(p != m);
                        upload[p] += 1;
                    }
                }
            }
            for (m, &up) in upload.iter().enumerate() {
                if plan.is_straggler(m) && fast >= d.max(1) {
                    prop_assert_eq!(up, 0, "straggler {} serves", m);
                }
                // Inner in its one stripe: at most d inner children and an even share of the
                // rest (each a 1/d share of the chunks); a leaf elsewhere.
                if fast >= d {
                    let gmin = fast / d;
                    let most = ((n - 1).div_ceil(gmin) + 1) as f64 / d as f64;
                    let payloads = up as f64 / d as f64;
                    prop_assert!(payloads <= most, "member {m} uploads {payloads} payloads, more than {most}");
                }
            }
        }
    }

    proptest! {
        /// In join order: the same shape guarantees as by rate (no cycle, stragglers serve no
        /// one, one root per stripe), and a member that joins last moves no earlier member's
        /// parent in a tree that earlier member is inner in: members that list each other at
        /// different moments never fetch a stripe from each other in a cycle.
        #[test]
        fn in_join_order_a_late_joiner_moves_no_inner_parent(
            rates in proptest::collection::vec(prop_oneof![4 => 0.5f64..2.0, 1 => 0.01f64..0.2, 1 => Just(0.0)], 2..120),
            d in 1usize..9,
        ) {
            let n = rates.len();
            let before = StripePlan::in_join_order(&rates[..n - 1], d, 0.5, &[]);
            let after = StripePlan::in_join_order(&rates, d, 0.5, &[]);
            let fast = (0..n).filter(|&m| !after.is_straggler(m)).count();
            for s in 0..d {
                prop_assert!(after.children(s, Parent::Source).len() <= 1);
                for m in 0..n {
                    prop_assert!(after.depth(s, m).is_some(), "a cycle in stripe {s}");
                    if after.is_straggler(m) && fast > 0 {
                        prop_assert!(after.children(s, Parent::Member(m)).is_empty());
                    }
                }
                // The median moves with the newcomer's rate, so compare only when no one
                // crossed the straggler threshold.
                let same = (0..n - 1).all(|m| before.is_straggler(m) == after.is_straggler(m))
                    // A stripe whose own group was empty borrowed another's tree.
                    && (0..n - 1).any(|m| m % d == s && !before.is_straggler(m));
                for m in 0..n - 1 {
                    let inner = !before.children(s, Parent::Member(m)).is_empty()
                        || before.children(s, Parent::Source).contains(&m);
                    if same && inner && !after.is_straggler(n - 1) {
                        prop_assert_eq!(before.parent(s, m), after.parent(s, m), "member {} moved in stripe {}", m, s);
                    }
                }
            }
        }
    }

    /// Members numbered `0..n` but for the holes in `gone` (members that left), with rates.
    fn numbered_fleet(rates: &[f64], gone: &[bool]) -> (Vec<u64>, Vec<f64>) {
        (0..rates.len())
            .filter(|&k| !gone[k])
            .map(|k| (k as u64, rates[k]))
            .unzip()
    }

    /// The depth bound of a numbered plan over numbers `0..span`: a `d`-ary heap of a group's
    /// slots, the leaf hop, and the acting root's hop.
    fn numbered_depth_bound(span: usize, d: usize) -> usize {
        let per = span.max(1).div_ceil(d);
        let mut depth = 1;
        let mut cap = 1usize;
        let mut level = 1usize;
        while cap < per {
            level = level.saturating_mul(d);
            cap = cap.saturating_add(level);
            depth += 1;
        }
        depth + 2
    }

    proptest! {
        /// Numbered: no cycle, depth within the heap of the numbers' span plus two, stragglers
        /// serve no one, one root per stripe (source egress one payload), and with no holes
        /// every member uploads about one payload.
        #[test]
        fn numbered_trees_are_shallow_and_balanced_and_send_once_from_the_source(
            rates in proptest::collection::vec(prop_oneof![6 => 0.5f64..2.0, 1 => 0.01f64..0.2, 1 => Just(0.0)], 1..200),
            gone in proptest::collection::vec(prop_oneof![5 => Just(false), 1 => Just(true)], 200),
            d in 1usize..6,
        ) {
            let (numbers, r) = numbered_fleet(&rates, &gone[..rates.len()]);
            prop_assume!(!numbers.is_empty());
            let n = numbers.len();
            let plan = StripePlan::numbered(&numbers, &r, d, 0.5, &[]);
            let fast = (0..n).filter(|&m| !plan.is_straggler(m)).count();
            let bound = numbered_depth_bound(rates.len(), d);
            let mut upload = vec![0usize; n];
            for s in 0..d {
                prop_assert!(plan.children(s, Parent::Source).len() <= 1);
                for m in 0..n {
                    let depth = plan.depth(s, m);
                    prop_assert!(depth.is_some(), "a cycle in stripe {}", s);
                    prop_assert!(depth.unwrap_or(0) <= bound, "member {} at depth {:?} > {}", m, depth, bound);
                    if let Parent::Member(p) = plan.parent(s, m) {
                        prop_assert!(p != m);
                        prop_assert!(!plan.is_straggler(p) || fast == 0, "straggler {} serves", p);
                        upload[p] += 1;
                    }
                }
            }
            if n == rates.len() && fast == n && n >= d * d {
                for (m, &up) in upload.iter().enumerate() {
                    // Inner in one stripe with at most d children there (a 1/d share each),
                    // at most one child more from the leaves' rounding: about one payload.
                    prop_assert!(up <= d + 1, "member {} serves {} children", m, up);
                }
            }
        }

        /// Numbered: from a plan without holes, a member that leaves changes the parent of no
        /// one whose parent it was not (while no one crosses the straggler threshold and it did
        /// not hold the highest number); with holes, no member whose parent in the layout is
        /// listed moves; a member that joins with a new highest number moves no inner parent.
        #[test]
        fn numbered_a_departure_moves_only_its_children_and_a_late_joiner_no_inner_parent(
            rates in proptest::collection::vec(prop_oneof![6 => 0.5f64..2.0, 1 => 0.01f64..0.2, 1 => Just(0.0)], 2..150),
            gone in proptest::collection::vec(prop_oneof![6 => Just(false), 1 => Just(true)], 150),
            holes in proptest::bool::ANY,
            leaver in 0usize..150,
            d in 1usize..6,
        ) {
            let len = rates.len();
            let gone = if holes { gone[..len].to_vec() } else { vec![false; len] };
            let (numbers, r) = numbered_fleet(&rates, &gone);
            prop_assume!(numbers.len() >= 2);
            let x = leaver % numbers.len();
            let max = numbers.iter().copied().max().unwrap_or(0);
            let before = StripePlan::numbered(&numbers, &r, d, 0.5, &[]);
            let mut gone_after = gone.clone();
            gone_after[numbers[x] as usize] = true;
            let (numbers_after, r_after) = numbered_fleet(&rates, &gone_after);
            let after = StripePlan::numbered(&numbers_after, &r_after, d, 0.5, &[]);
            // Index in `after` of the member at index `m` of `before` (not x).
            let moved = |m: usize| if m < x { m } else { m - 1 };
            let same = (0..numbers.len())
                .filter(|&m| m != x)
                .all(|m| before.is_straggler(m) == after.is_straggler(moved(m)));
            let serving = |k: u64| {
                numbers_after.iter().position(|&y| y == k).filter(|&i| !after.is_straggler(i))
            };
            // A stripe whose group has no member that serves borrows another's tree.
            let own = |s: usize| (0..numbers_after.len()).any(|i| numbers_after[i] as usize % d == s && !after.is_straggler(i));
            if same && numbers[x] != max {
                for s in (0..d).filter(|&s| own(s)) {
                    let up = layout(max as usize + 1, d, s);
                    for m in (0..numbers.len()).filter(|&m| m != x) {
                        let was = before.parent(s, m);
                        if was == Parent::Member(x) {
                            continue;
                        }
                        let was = match was {
                            Parent::Member(p) => Parent::Member(moved(p)),
                            p => p,
                        };
                        let now = after.parent(s, moved(m));
                        if !holes && (0..numbers.len()).all(|m| !before.is_straggler(m)) {
                            prop_assert_eq!(was, now, "member {} moved in stripe {}", numbers[m], s);
                        }
                        if let Some(q) = up[numbers[m] as usize].and_then(|q| serving(q as u64)) {
                            prop_assert_eq!(now, Parent::Member(q), "member {} left its listed layout parent in stripe {}", numbers[m], s);
                        }
                    }
                }
            }
            // A late joiner, numbered after everyone: no inner parent moves.
            let mut joined = numbers.clone();
            joined.push(max + 1);
            let mut rj = r.clone();
            rj.push(1.0);
            let later = StripePlan::numbered(&joined, &rj, d, 0.5, &[]);
            let same = (0..numbers.len()).all(|m| before.is_straggler(m) == later.is_straggler(m));
            if same {
                // A stripe whose group had no member that serves borrowed another's tree.
                let own = |s: usize| {
                    (0..numbers.len()).any(|m| numbers[m] as usize % d == s && !before.is_straggler(m))
                };
                // Orphans of holes are placed by the children counts of the moment, which
                // a newcomer changes: only members on their layout parent are held to it.
                let serving_before = |k: usize| {
                    numbers.iter().position(|&y| y as usize == k).is_some_and(|i| !before.is_straggler(i))
                };
                for s in (0..d).filter(|&s| own(s)) {
                    let up = layout(max as usize + 1, d, s);
                    for m in 0..numbers.len() {
                        let inner = !before.children(s, Parent::Member(m)).is_empty()
                            || before.children(s, Parent::Source).contains(&m);
                        let on_layout = match up[numbers[m] as usize] {
                            Some(q) => serving_before(q),
                            None => !before.is_straggler(m),
                        };
                        if inner && on_layout {
                            prop_assert_eq!(before.parent(s, m), later.parent(s, m), "inner member {} moved in stripe {}", numbers[m], s);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn numbered_any_one_departure_from_eight_leaves_every_tree_at_two_children_at_most() {
        // The shaped-namespace bench's fleet, d = 2: whoever dies, its children take the
        // places its parent and the layout's rounding left, so no one serves a stripe to
        // three (which would hold that stripe to two thirds of the link).
        for victim in 0..8u64 {
            let left: Vec<u64> = (0..8).filter(|&k| k != victim).collect();
            let plan = StripePlan::numbered(&left, &[1.0; 7], 2, 0.5, &[]);
            for s in 0..2 {
                assert_eq!(plan.children(s, Parent::Source).len(), 1);
                for m in 0..7 {
                    assert!(
                        plan.children(s, Parent::Member(m)).len() <= 2,
                        "victim {victim}, stripe {s}: {plan:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn numbered_a_dead_root_hands_its_stripe_to_the_next_of_its_group() {
        // d = 2, numbers 0..8: group 0 is 0, 2, 4, 6 (0 the root of stripe 0).
        let rates = vec![1.0; 8];
        let all: Vec<u64> = (0..8).collect();
        let plan = StripePlan::numbered(&all, &rates, 2, 0.5, &[]);
        assert_eq!(plan.parent(0, 0), Parent::Source);
        assert_eq!(plan.parent(0, 2), Parent::Member(0));
        assert_eq!(plan.parent(0, 6), Parent::Member(2));
        assert_eq!(plan.parent(1, 1), Parent::Source);
        // 0 leaves: 2, the lowest of its group, fetches stripe 0 from the source; 0's other
        // children take the places with the fewest children; no one else moves, and every
        // member of stripe 0's tree has two children at most.
        let left: Vec<u64> = (1..8).collect();
        let after = StripePlan::numbered(&left, &rates[1..], 2, 0.5, &[]);
        let at = |k: u64| left.iter().position(|&x| x == k).unwrap_or(usize::MAX);
        assert_eq!(after.parent(0, at(2)), Parent::Source);
        assert_eq!(after.parent(0, at(6)), Parent::Member(at(2)));
        assert_eq!(after.children(0, Parent::Source), [at(2)]);
        for m in 0..7 {
            assert!(after.children(0, Parent::Member(m)).len() <= 2);
            assert_eq!(after.parent(1, m), plan.parent(1, m + 1).shifted_down());
        }
        // 4 leaves (inner, children 1 and 7): its parent's free place and the place the
        // layout's rounding left (6 had one child) take them; no one else moves.
        let left: Vec<u64> = [0, 1, 2, 3, 5, 6, 7].into();
        let after = StripePlan::numbered(&left, &[1.0; 7], 2, 0.5, &[]);
        let at = |k: u64| left.iter().position(|&x| x == k).unwrap_or(usize::MAX);
        for m in 0..7 {
            assert!(
                after.children(0, Parent::Member(m)).len() <= 2,
                "{:?}",
                after
            );
        }
        assert_eq!(after.parent(0, at(2)), Parent::Member(at(0)));
        assert_eq!(after.parent(0, at(6)), Parent::Member(at(2)));
        // Numbers not distinct: join order.
        let dup = StripePlan::numbered(&[0, 0, 1], &[1.0; 3], 1, 0.5, &[]);
        assert_eq!(dup.parent(0, 1), Parent::Member(0));
        assert_eq!(dup.parent(0, 2), Parent::Member(1));
    }

    #[test]
    fn in_join_order_one_stripe_is_the_chain_with_stragglers_at_its_end() {
        let mut rates = vec![1.0; 5];
        rates[2] = 0.1;
        let plan = StripePlan::in_join_order(&rates, 1, 0.5, &[]);
        assert_eq!(plan.parent(0, 0), Parent::Source);
        assert_eq!(plan.parent(0, 1), Parent::Member(0));
        assert_eq!(plan.parent(0, 3), Parent::Member(1));
        assert_eq!(plan.parent(0, 4), Parent::Member(3));
        assert_eq!(
            plan.parent(0, 2),
            Parent::Member(4),
            "the straggler at the end"
        );
    }

    #[test]
    fn a_slow_member_is_a_leaf_and_its_children_move() {
        let mut rates = vec![1.0; 20];
        let plan = StripePlan::new(&rates, 4, 0.5);
        let inner =
            (0..4).find_map(|s| (0..20).find(|&m| !plan.children(s, Parent::Member(m)).is_empty()));
        let slow = inner.unwrap_or(0);
        rates[slow] = 0.2;
        let plan = StripePlan::new(&rates, 4, 0.5);
        assert!(plan.is_straggler(slow));
        for s in 0..4 {
            assert!(plan.children(s, Parent::Member(slow)).is_empty());
            assert!(matches!(plan.parent(s, slow), Parent::Member(_)));
        }
    }
}
