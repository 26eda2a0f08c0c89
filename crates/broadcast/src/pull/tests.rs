//! The pull's rules, event by event, with no sockets.

use super::*;
use crate::error::BroadcastError;

fn member(id: &str, role: Role) -> Member {
    Member {
        id: id.into(),
        epoch: 1,
        source_epoch: 1,
        data_addr: format!("10.0.0.1:{}", id.len()),
        ctl_addr: String::new(),
        role,
        progress: 0,
        done: false,
        order: 0,
        version: 3,
        rate: 0,
        number: None,
        identity: None,
    }
}

#[test]
fn a_holder_that_sends_nothing_for_stall_after_is_given_up_whatever_its_role() {
    let t0 = Instant::now();
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let stall = Duration::from_secs(3);
    let have = Have::striped(16, 2);
    let members = vec![
        member("src", Role::Source),
        member("a", Role::Receiver),
        member("b", Role::Receiver),
    ];
    let mut src = Seen::new(members[0].clone(), 16, t0);
    src.in_flight = 8;
    let mut a = Seen::new(members[1].clone(), 16, t0);
    a.update(4, 4, Vec::new(), false, t0);
    let run = |holders: &[(&str, &Seen)], assigned: &[Option<String>], list: &[Member], s| {
        stalled(holders.iter().copied(), assigned, &have, list, stall, at(s))
    };
    let assigned = vec![Some("src".to_owned()), Some("a".to_owned())];
    let both = [("src", &src), ("a", &a)];
    assert!(run(&both, &assigned, &members, 2.9).is_empty());
    // Past the window: the source, whose chunks are in flight; the relay, which still has
    // chunks to give, is kept.
    let out = run(&both, &assigned, &members, 3.5);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, "src");
    assert_eq!(
        out[0].1.to_string(),
        "sent nothing for 3.5 s while 8 chunks were requested from it"
    );
    // A chunk from it restarts its silence.
    src.heard = at(3.0);
    assert!(run(&[("src", &src)], &assigned, &members, 3.5).is_empty());
    // Nothing asked of it: the source is never waited on.
    src.in_flight = 0;
    assert!(run(&[("src", &src)], &assigned, &members, 60.0).is_empty());
    // A parent with nothing this receiver wants that advertises nothing new.
    let b = Seen::new(members[2].clone(), 16, t0);
    let assigned = vec![Some("src".to_owned()), Some("b".to_owned())];
    assert!(run(&[("b", &b)], &assigned, &members, 2.0).is_empty());
    let out = run(&[("b", &b)], &assigned, &members, 3.5);
    assert!(
        matches!(out[..], [(ref id, GiveUp::Stalled { in_flight: 0, .. })] if id == "b"),
        "{out:?}"
    );
    assert!(out[0].1.to_string().starts_with("advertised nothing new"));
    // A holder that is no stripe's parent is not waited on.
    let unassigned = vec![Some("src".to_owned()), None];
    assert!(run(&[("b", &b)], &unassigned, &members, 3.5).is_empty());
    // A parent off the list is given up at once; the list never read takes no one off.
    let out = run(&[("b", &b)], &assigned, &members[..2], 0.1);
    assert!(matches!(out[..], [(_, GiveUp::Unlisted)]), "{out:?}");
    assert!(run(&[("b", &b)], &assigned, &[], 0.1).is_empty());
    // The source off a list that was read (its lease ran out in etcd).
    let out = run(&[("src", &src)], &assigned, &members[1..], 0.1);
    assert!(matches!(out[..], [(_, GiveUp::Unlisted)]), "{out:?}");
}

use super::sim::{Fleet, Kind, Leaving, STALL, TICK};
use proptest::prelude::*;

fn fleet(relays: Vec<Kind>) -> Fleet {
    Fleet {
        chunks: 24,
        stripes: 2,
        window: 4,
        relay: true,
        verify_at_rest: true,
        source_dies: None,
        relays,
        bad_at_rest: Vec::new(),
    }
}

const GOOD: Kind = Kind::Good { per_chunk: 1 };

#[test]
fn a_fleet_of_good_relays_completes_without_giving_anyone_up() {
    let e = fleet(vec![GOOD, GOOD, GOOD]).run();
    e.result.unwrap();
    assert!(e.given_up.is_empty(), "{:?}", e.given_up);
    let t = e.pull.tally();
    assert_eq!(t.refetched, 0);
    assert!(t.bytes_from_relays > 0, "nothing came from the relays");
    assert_eq!(t.bytes_from_source + t.bytes_from_relays, 24 * 1000);
}

#[test]
fn from_the_source_only_no_relay_is_attached() {
    let mut f = fleet(vec![GOOD, GOOD]);
    f.relay = false;
    let e = f.run();
    e.result.unwrap();
    assert_eq!(e.fetches.keys().collect::<Vec<_>>(), ["src"]);
    assert_eq!(e.pull.tally().holders, ["src"]);
}

#[test]
fn a_corrupting_relay_is_given_up_once_and_its_chunk_fetched_from_the_source() {
    let mut f = fleet(vec![Kind::Corrupt]);
    f.stripes = 1;
    let e = f.run();
    e.result.unwrap();
    assert_eq!(e.given_up, ["r0"]);
    let t = e.pull.tally();
    assert_eq!(t.corrupt_holders, ["r0"]);
    assert_eq!(t.fetch_mismatches, 1);
    assert_eq!(t.refetched, 1);
    assert_eq!(t.parents_given_up, 1);
}

#[test]
fn a_dead_relay_and_one_that_stops_answering_are_given_up() {
    for k in [Kind::Dead, Kind::PollFails] {
        let mut f = fleet(vec![k]);
        f.stripes = 1;
        let e = f.run();
        e.result.unwrap();
        assert_eq!(e.given_up, ["r0"], "{k:?}");
        assert_eq!(e.pull.tally().corrupt_holders.len(), 0);
        assert_eq!(e.pull.tally().parents_given_up, 1);
    }
}

#[test]
fn a_silent_relay_is_given_up_after_stall_after_and_not_before() {
    let mut f = fleet(vec![Kind::Silent]);
    f.stripes = 1;
    let e = f.run();
    e.result.unwrap();
    assert_eq!(e.given_up, ["r0"]);
    let stall = (STALL.as_millis() / TICK.as_millis()) as u32;
    assert!(e.ticks > stall, "done in {} ticks", e.ticks);
    assert!(e.ticks < 3 * stall, "waited {} ticks", e.ticks);
}

#[test]
fn relays_of_another_epoch_or_version_or_that_cannot_be_attached_are_given_up() {
    for k in [Kind::OtherEpoch, Kind::OtherVersion, Kind::Unattachable] {
        let mut f = fleet(vec![k]);
        f.stripes = 1;
        let e = f.run();
        e.result.unwrap();
        assert_eq!(e.pull.tally().refetched, 0, "{k:?}");
        assert!(!e.fetches.contains_key("r0"), "{k:?}: fetched from it");
        assert_eq!(e.pull.avoid.iter().collect::<Vec<_>>(), ["r0"], "{k:?}");
    }
    let mut f = fleet(vec![Kind::OtherEpoch]);
    f.stripes = 1;
    let e = f.run();
    match &e.pull.last {
        Some((who, GiveUp::OtherEpoch(8))) => assert!(who.starts_with("relay")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_parent_that_leaves_the_list_is_given_up() {
    let mut f = fleet(vec![Kind::Leaves { at: 3 }]);
    f.stripes = 1;
    let e = f.run();
    e.result.unwrap();
    assert_eq!(e.given_up, ["r0"]);
    assert!(matches!(e.pull.last, Some((_, GiveUp::Unlisted))));
}

/// A relay finished before this receiver attached it answers its progress once, and the
/// driver may hand that answer in before the attachment's end: kept, not dropped, so the
/// pull fetches from it at once rather than waiting on it for `stall_after` (the 3 s updates
/// of issue 48 when finished receivers left at once).
#[test]
fn a_finished_relays_one_answer_before_its_attachment_ends_is_kept() {
    for stripes in [1, 2] {
        let mut f = fleet(vec![Kind::Finished]);
        f.stripes = stripes;
        let e = f.run();
        e.result.unwrap();
        assert!(e.given_up.is_empty(), "{:?}: {:?}", e.given_up, e.why);
        let t = e.pull.tally();
        assert_eq!((t.stalled, t.left), (0, 0));
        assert!(
            t.bytes_from_relays > 0,
            "nothing came from the finished relay"
        );
        assert!(
            e.ticks * TICK < STALL,
            "{} ticks: it waited on the finished relay",
            e.ticks
        );
    }
}

/// A finished relay that leaves while chunks are asked of it (its READs then never finish) is
/// given up as soon as the pull learns it left, by its control connection closing or by the
/// list, parent or not; its chunks go to the plan made again (here the source): no stall.
#[test]
fn a_holder_that_leaves_mid_plan_is_given_up_at_once_and_its_chunks_replanned() {
    for by in [Leaving::Link, Leaving::List] {
        for stripes in [1, 2] {
            let mut f = fleet(vec![Kind::FinishedLeaves { at: 2, by }]);
            f.stripes = stripes;
            f.chunks = 48;
            let e = f.run();
            e.result.unwrap();
            assert_eq!(e.given_up, ["r0"], "{by:?}, {stripes} stripes");
            let (why, tick) = &e.why[0];
            let want_left = matches!(
                (why, by),
                (GiveUp::Left(_), Leaving::Link) | (GiveUp::Unlisted, Leaving::List)
            );
            assert!(want_left, "{by:?}: given up for {why}");
            // Within the tick it left (its wake), not once its silence reached STALL.
            assert!(
                *tick <= 2 && TICK < STALL,
                "{by:?}, {stripes} stripes: given up at tick {tick}, it left at 2"
            );
            let t = e.pull.tally();
            assert_eq!((t.stalled, t.left), (0, 1), "{by:?}");
            assert!(
                t.bytes_from_relays > 0,
                "nothing came from r0 before it left"
            );
        }
    }
}

/// The stall check itself: a relay that is no stripe's parent any more (the plan was made
/// again) but still has chunks in flight is held to the list too.
#[test]
fn a_holder_off_the_list_with_chunks_in_flight_is_given_up_parent_or_not() {
    let t0 = Instant::now();
    let have = Have::striped(16, 2);
    let members = vec![member("src", Role::Source), member("a", Role::Receiver)];
    let mut a = Seen::new(members[1].clone(), 16, t0);
    a.update(16, 16, Vec::new(), true, t0);
    a.in_flight = 2;
    let none: Vec<Option<String>> = vec![Some("src".into()), Some("src".into())];
    let stall = Duration::from_secs(3);
    let listed = stalled([("a", &a)].into_iter(), &none, &have, &members, stall, t0);
    assert!(listed.is_empty(), "{listed:?}");
    let gone = stalled(
        [("a", &a)].into_iter(),
        &none,
        &have,
        &members[..1],
        stall,
        t0,
    );
    assert!(matches!(gone[..], [(_, GiveUp::Unlisted)]), "{gone:?}");
    // Nothing in flight and no stripe's parent: nothing to give up (the plan drops it).
    a.in_flight = 0;
    let idle = stalled(
        [("a", &a)].into_iter(),
        &none,
        &have,
        &members[..1],
        stall,
        t0,
    );
    assert!(idle.is_empty(), "{idle:?}");
}

#[test]
fn a_source_that_cannot_be_attached_ends_a_pull_no_one_else_serves_naming_it() {
    let mut f = fleet(Vec::new());
    f.source_dies = Some(0);
    let e = f.run();
    match e.result {
        Err(BroadcastError::Stalled {
            holder, verified, ..
        }) => {
            assert!(holder.starts_with("the source"), "{holder}");
            assert_eq!(verified, 0);
        }
        other => panic!("{other:?}"),
    }
    // At once: nothing will come, there is nothing to wait for.
    assert_eq!(e.ticks, 0);
}

#[test]
fn a_source_that_stops_mid_pull_is_given_up_as_stalled() {
    let mut f = fleet(Vec::new());
    f.window = 1;
    f.source_dies = Some(5);
    let e = f.run();
    match e.result {
        Err(BroadcastError::Stalled {
            holder,
            reason,
            verified,
            ..
        }) => {
            assert!(holder.starts_with("the source"), "{holder}");
            assert!(reason.starts_with("sent nothing"), "{reason}");
            assert!(verified > 0 && verified < 24, "{verified}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.given_up, ["src"]);
}

#[test]
fn with_the_source_gone_a_relay_that_holds_everything_serves_the_rest() {
    let mut f = fleet(vec![GOOD]);
    f.stripes = 1;
    f.relay = true;
    f.source_dies = Some(2);
    // Its stripe comes from the relay: the source is not needed.
    let e = f.run();
    e.result.unwrap();
}

#[test]
fn the_check_at_rest_fetches_what_changed_again_once() {
    let mut f = fleet(vec![GOOD]);
    f.bad_at_rest = vec![2, 5];
    let e = f.run();
    e.result.unwrap();
    let t = e.pull.tally();
    assert_eq!(t.at_rest_mismatches, 2);
    assert_eq!(t.refetched, 2);
    assert_eq!(e.pull.verified_bytes(), 24 * 1000);
    // Without the check, nothing is fetched again.
    f.verify_at_rest = false;
    let e = f.run();
    e.result.unwrap();
    assert_eq!(e.pull.tally().at_rest_mismatches, 0);
}

/// Answers the pull's commands by hand: attaches whatever it asks, returns the fetches.
fn drive(p: &mut Pull, now: Instant) -> Vec<(usize, String, u64)> {
    let mut fetches = Vec::new();
    while let Some(c) = p.poll(now).unwrap() {
        match c {
            Command::Attach(_) => p.handle(now, Event::Attached).unwrap(),
            Command::Fetch {
                chunk,
                holder,
                generation,
            } => fetches.push((chunk, holder, generation)),
            _ => {}
        }
    }
    fetches
}

fn source_only_config(chunks: usize, window: usize) -> Config {
    let f = Fleet {
        chunks,
        stripes: 1,
        window,
        relay: false,
        verify_at_rest: false,
        source_dies: None,
        relays: Vec::new(),
        bad_at_rest: Vec::new(),
    };
    let mut cfg = f.config();
    cfg.source_epoch = 1;
    cfg
}

fn source_only(chunks: usize, window: usize) -> Pull {
    Pull::new(
        source_only_config(chunks, window),
        vec![member("src", Role::Source)],
        Instant::now(),
    )
}

fn fetched(chunk: usize, generation: u64, outcome: Outcome) -> Event {
    Event::Fetched {
        chunk,
        from: "src".into(),
        generation,
        from_source: true,
        outcome,
    }
}

#[test]
fn the_source_answering_for_another_epoch_ends_the_pull() {
    let now = Instant::now();
    let mut p = source_only(4, 2);
    assert_eq!(drive(&mut p, now).len(), 2);
    let progress = |epoch| Event::Progress {
        id: "src".into(),
        source_epoch: epoch,
        prefix: 4,
        done: true,
        version: 3,
        count: 4,
        stripes: Vec::new(),
    };
    p.handle(now, progress(1)).unwrap();
    assert!(matches!(
        p.handle(now, progress(2)),
        Err(BroadcastError::SourceRestarted {
            had: 1,
            found: 2,
            ..
        })
    ));
    assert!(p.handle(now, Event::SourceEpoch(1)).is_ok());
    assert!(matches!(
        p.handle(now, Event::SourceEpoch(9)),
        Err(BroadcastError::SourceRestarted { found: 9, .. })
    ));
}

#[test]
fn a_chunk_the_source_serves_wrong_four_times_ends_the_pull() {
    let now = Instant::now();
    let mut p = source_only(1, 1);
    let mut f = drive(&mut p, now);
    for tries in 1..=4 {
        let (chunk, _, g) = f.pop().unwrap();
        let r = p.handle(now, fetched(chunk, g, Outcome::Mismatch));
        if tries <= 3 {
            r.unwrap();
            f = drive(&mut p, now);
            assert_eq!(f.len(), 1, "fetched again from the source");
        } else {
            assert!(matches!(r, Err(BroadcastError::NoHolder { chunk: 0, .. })));
        }
    }
    assert!(
        p.tally().corrupt_holders.is_empty(),
        "the source is not a relay"
    );
}

/// The pull names when it needs waking: its first heartbeat at once, then the moment the
/// holder it waits on counts as stalled (moved by every chunk that holder sends). A wake just
/// before that changes nothing; a wake at it gives the holder up.
#[test]
fn next_wake_names_the_heartbeat_and_the_stall_deadline_and_a_wake_then_acts() {
    let t0 = Instant::now();
    let mut cfg = source_only_config(4, 2);
    cfg.heartbeat = cfg.stall_after * 10;
    let stall = cfg.stall_after;
    let mut p = Pull::new(cfg, vec![member("src", Role::Source)], t0);
    assert_eq!(
        p.next_wake(),
        Some(t0),
        "the first heartbeat is due at once"
    );
    p.handle(t0, Event::Wake).unwrap();
    let mut commands = Vec::new();
    while let Some(c) = p.poll(t0).unwrap() {
        if matches!(c, Command::Attach(_)) {
            p.handle(t0, Event::Attached).unwrap();
        }
        commands.push(c);
    }
    assert!(
        commands.contains(&Command::Heartbeat) && commands.contains(&Command::Publish),
        "{commands:?}"
    );
    let fetches: Vec<(usize, u64)> = commands
        .iter()
        .filter_map(|c| match c {
            Command::Fetch {
                chunk, generation, ..
            } => Some((*chunk, *generation)),
            _ => None,
        })
        .collect();
    assert_eq!(fetches.len(), 2, "{commands:?}");
    assert_eq!(p.next_wake(), Some(t0 + stall), "two chunks asked at t0");
    let t1 = t0 + stall / 2;
    let (chunk, generation) = fetches[0];
    p.handle(t1, fetched(chunk, generation, Outcome::Verified))
        .unwrap();
    assert_eq!(drive(&mut p, t1).len(), 1, "the window refilled");
    assert_eq!(p.next_wake(), Some(t1 + stall), "a chunk came at t1");
    // A wake before the deadline (no heartbeat due either) gives no one up.
    p.handle(t1 + stall - Duration::from_millis(1), Event::Wake)
        .unwrap();
    assert_eq!(p.poll(t1 + stall).unwrap(), None);
    p.handle(t1 + stall, Event::Wake).unwrap();
    match p.poll(t1 + stall).unwrap() {
        Some(Command::GiveUp {
            id,
            why: GiveUp::Stalled { after, in_flight },
            ..
        }) => {
            assert_eq!(id, "src");
            assert_eq!((after, in_flight), (stall, 2));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_held_pull_starts_no_fetch_and_a_held_check_keeps_it_from_done() {
    let now = Instant::now();
    let mut p = source_only(2, 1);
    p.hold_fetches(true);
    assert!(drive(&mut p, now).is_empty());
    p.hold_fetches(false);
    p.hold_check(true);
    for _ in 0..2 {
        let (c, _, g) = drive(&mut p, now).pop().unwrap();
        p.handle(now, fetched(c, g, Outcome::Verified)).unwrap();
    }
    assert!(p.have().is_done());
    while let Some(c) = p.poll(now).unwrap() {
        assert_ne!(c, Command::Done);
    }
    p.hold_check(false);
    assert_eq!(p.poll(now).unwrap(), Some(Command::Done));
}

#[test]
fn a_read_failed_from_an_earlier_attachment_gives_up_no_one() {
    let now = Instant::now();
    let mut p = source_only(2, 2);
    let f = drive(&mut p, now);
    assert_eq!(f.len(), 2);
    let (c, _, g) = f[0].clone();
    let stale = Event::Fetched {
        chunk: c,
        from: "src".into(),
        generation: g + 1,
        from_source: true,
        outcome: Outcome::ReadFailed("reset".into()),
    };
    p.handle(now, stale).unwrap();
    assert!(
        p.holders.contains_key("src"),
        "given up for another attachment's READ"
    );
    let (c, _, g) = f[1].clone();
    p.handle(now, fetched(c, g, Outcome::ReadFailed("reset".into())))
        .unwrap();
    assert!(!p.holders.contains_key("src"));
    let gave: Vec<Command> = std::iter::from_fn(|| p.poll(now).ok().flatten()).collect();
    assert_eq!(
        gave.iter()
            .filter(|c| matches!(c, Command::GiveUp { .. }))
            .count(),
        1
    );
    // A second failure of the same holder gives up nothing more.
    p.handle(now, fetched(c, g, Outcome::ReadFailed("reset".into())))
        .unwrap_or(());
    let again: Vec<Command> = std::iter::from_fn(|| p.poll(now).ok().flatten()).collect();
    assert!(
        !again.iter().any(|c| matches!(c, Command::GiveUp { .. })),
        "{again:?}"
    );
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        4 => (1u32..5).prop_map(|per_chunk| Kind::Good { per_chunk }),
        1 => Just(Kind::Dead),
        1 => Just(Kind::Silent),
        1 => Just(Kind::Corrupt),
        1 => Just(Kind::OtherEpoch),
        1 => Just(Kind::OtherVersion),
        1 => Just(Kind::Unattachable),
        1 => (1u32..40).prop_map(|at| Kind::Leaves { at }),
        1 => Just(Kind::PollFails),
        1 => Just(Kind::Finished),
        1 => (1u32..40, prop_oneof![Just(Leaving::Link), Just(Leaving::List)])
            .prop_map(|(at, by)| Kind::FinishedLeaves { at, by }),
    ]
}

fn any_fleet() -> impl Strategy<Value = Fleet> {
    (
        1usize..40,
        1usize..4,
        1usize..9,
        any::<bool>(),
        any::<bool>(),
        proptest::option::weighted(0.25, 0u32..60),
        proptest::collection::vec(kind(), 0..6),
        proptest::collection::vec(0usize..40, 0..3),
    )
        .prop_map(
            |(chunks, stripes, window, relay, verify_at_rest, source_dies, relays, bad)| Fleet {
                chunks,
                stripes,
                window,
                relay,
                verify_at_rest,
                source_dies,
                relays,
                bad_at_rest: bad.into_iter().filter(|&c| c < chunks).collect(),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// On any fleet the rules hold at every step (the simulation checks them: fetches only
    /// from holders attached that advertised the chunk, within the window; each holder given
    /// up once and never attached again; done only with every chunk verified and nothing in
    /// flight), a pull whose source stays up completes, a good relay is never given up, and
    /// only a corrupting relay is reported corrupt.
    #[test]
    fn any_fleet_keeps_the_rules(f in any_fleet()) {
        let e = f.run();
        if f.source_dies.is_none() {
            prop_assert!(e.result.is_ok(), "{:?}", e.result);
        } else if let Err(err) = &e.result {
            prop_assert!(
                matches!(err, BroadcastError::Stalled { .. } | BroadcastError::NoHolder { .. }),
                "{err}"
            );
        }
        for (id, (why, _)) in e.given_up.iter().zip(&e.why) {
            let k = id.strip_prefix('r').and_then(|i| i.parse::<usize>().ok()).map(|i| f.relays[i]);
            prop_assert!(
                !matches!(k, Some(Kind::Good { .. } | Kind::Finished)),
                "good relay {} given up ({})", id, why
            );
            // One that left is given up for leaving, never waited on until it counts as
            // stalled.
            if matches!(k, Some(Kind::FinishedLeaves { .. })) {
                prop_assert!(
                    matches!(why, GiveUp::Left(_) | GiveUp::Unlisted),
                    "{} given up for {}, not for leaving", id, why
                );
            }
            prop_assert!(id != "src" || f.source_dies.is_some(), "a live source given up");
        }
        for id in &e.pull.tally().corrupt_holders {
            let i: usize = id[1..].parse().unwrap();
            prop_assert_eq!(f.relays[i], Kind::Corrupt);
        }
        if e.result.is_ok() {
            let t = e.pull.tally();
            prop_assert_eq!(e.pull.verified_bytes(), f.chunks as u64 * 1000);
            prop_assert_eq!(t.at_rest_mismatches, if f.verify_at_rest { f.bad_at_rest.len() as u64 } else { 0 });
        }
    }
}

#[test]
fn a_fetch_that_could_not_start_is_asked_again_once_another_finishes() {
    let now = Instant::now();
    let mut p = source_only(3, 2);
    let f = drive(&mut p, now);
    assert_eq!(f.iter().map(|f| f.0).collect::<Vec<_>>(), [0, 1]);
    let (c, from, generation) = f[1].clone();
    p.handle(
        now,
        Event::NotStarted {
            chunk: c,
            from,
            generation,
        },
    )
    .unwrap();
    // No slot free: nothing more until a fetch finishes.
    assert!(drive(&mut p, now).is_empty());
    let (c0, _, g) = f[0].clone();
    p.handle(now, fetched(c0, g, Outcome::Verified)).unwrap();
    let again: Vec<usize> = drive(&mut p, now).iter().map(|f| f.0).collect();
    assert_eq!(again, [1, 2]);
}

#[test]
fn peers_are_the_members_it_may_fetch_from_not_itself_nor_those_gone_or_given_up() {
    let listed = ["src", "r0", "me"].map(|id| {
        let role = if id == "src" {
            Role::Source
        } else {
            Role::Receiver
        };
        member(id, role)
    });
    for k in [Kind::Unattachable, Kind::Leaves { at: 3 }] {
        let mut f = fleet(vec![k]);
        f.stripes = 1;
        let before = Pull::new(f.config(), listed.to_vec(), Instant::now());
        // The source and r0; not this receiver.
        assert_eq!(before.peers(), 2, "{k:?}");
        let e = f.run();
        e.result.unwrap();
        // r0 could not be attached (given up, though listed), or left the list: the source
        // remains.
        assert_eq!(e.pull.peers(), 1, "{k:?}");
    }
}

/// A holder's silence runs from the first chunk asked of it while nothing else was: asking it
/// for more chunks while it stays silent must not start the clock again, else a stalled holder
/// the window keeps feeding (here: slots freed by the source's chunks) is never given up.
#[test]
fn a_silent_holder_asked_for_more_is_given_up_from_its_first_chunk_asked_not_its_last() {
    use super::sim::member as listed;
    let t0 = Instant::now();
    let f = Fleet {
        chunks: 16,
        stripes: 2,
        window: 4,
        relay: true,
        verify_at_rest: false,
        source_dies: None,
        relays: vec![Kind::Silent],
        bad_at_rest: Vec::new(),
    };
    let cfg = f.config();
    let (stall, epoch, version) = (cfg.stall_after, cfg.source_epoch, cfg.version);
    let members = vec![
        listed("src", Role::Source, 0),
        listed("r0", Role::Receiver, 1),
        listed("me", Role::Receiver, 1000),
    ];
    let mut p = Pull::new(cfg, members, t0);
    let advertise = |p: &mut Pull, now| {
        p.handle(
            now,
            Event::Progress {
                id: "r0".into(),
                source_epoch: epoch,
                prefix: 16,
                done: true,
                version,
                count: 16,
                stripes: Vec::new(),
            },
        )
        .unwrap();
    };
    // Attach both holders and learn that r0 holds everything; the window fills at once.
    let mut asked = drive(&mut p, t0);
    advertise(&mut p, t0);
    asked.extend(drive(&mut p, t0));
    let from_r0 = |a: &[(usize, String, u64)]| a.iter().filter(|f| f.1 == "r0").count();
    // The source serves its chunks one by one, every tenth of the stall time; the slots they
    // free go to r0's stripe too, and r0 never answers.
    let mut first_to_r0 = (from_r0(&asked) > 0).then_some(t0);
    let mut later_to_r0 = 0;
    let mut step = 1;
    while let Some(i) = asked.iter().position(|f| f.1 == "src") {
        let now = t0 + stall * step / 10;
        if first_to_r0.is_some_and(|first| now >= first + stall) {
            break;
        }
        step += 1;
        let (chunk, _, generation) = asked.remove(i);
        p.handle(now, fetched(chunk, generation, Outcome::Verified))
            .unwrap();
        let more = drive(&mut p, now);
        if from_r0(&more) > 0 {
            if first_to_r0.is_none() {
                first_to_r0 = Some(now);
            } else {
                later_to_r0 += from_r0(&more);
            }
        }
        asked.extend(more);
    }
    let first = first_to_r0.expect("r0 was never asked: the test would not test");
    assert!(
        later_to_r0 > 0,
        "r0 was asked nothing after its first chunk: the test would not test"
    );
    // At its first chunk's deadline it is given up, whatever it was asked since.
    let deadline = first + stall;
    let before = deadline - Duration::from_millis(1);
    p.handle(before, Event::Wake).unwrap();
    while let Some(c) = p.poll(before).unwrap() {
        assert!(
            !matches!(c, Command::GiveUp { .. }),
            "given up early: {c:?}"
        );
    }
    p.handle(deadline, Event::Wake).unwrap();
    let mut gave_up = None;
    while let Some(c) = p.poll(deadline).unwrap() {
        if let Command::GiveUp { id, why, .. } = c {
            gave_up = Some((id, why));
            break;
        }
    }
    match gave_up {
        Some((id, GiveUp::Stalled { after, .. })) => {
            assert_eq!(id, "r0");
            assert_eq!(after, stall);
        }
        other => panic!("r0 not given up at its deadline: {other:?}"),
    }
}

#[test]
fn a_holder_quiet_past_half_its_stall_window_is_named_before_it_is_given_up() {
    let t0 = Instant::now();
    let cfg = source_only_config(4, 1);
    let stall = cfg.stall_after;
    let mut p = Pull::new(cfg, vec![member("src", Role::Source)], t0);
    let fetches = drive(&mut p, t0);
    assert_eq!(fetches.len(), 1);
    assert_eq!(
        p.waiting_on(t0 + stall / 4),
        None,
        "quiet, but not for long"
    );
    let (who, quiet) = p.waiting_on(t0 + stall * 3 / 4).expect("named");
    assert_eq!(who, "the source 10.0.0.1:3");
    assert_eq!(quiet, stall * 3 / 4);
    // A chunk comes: the source is not waited on any more.
    let (chunk, _, generation) = fetches[0];
    let t1 = t0 + stall * 3 / 4;
    p.handle(t1, fetched(chunk, generation, Outcome::Verified))
        .unwrap();
    drive(&mut p, t1);
    assert_eq!(p.waiting_on(t1 + stall / 4), None);
}

#[test]
fn a_pull_whose_own_process_was_stopped_blames_no_holder_for_the_gap() {
    let t0 = Instant::now();
    let cfg = source_only_config(4, 1);
    let stall = cfg.stall_after;
    let mut p = Pull::new(cfg, vec![member("src", Role::Source)], t0);
    assert_eq!(drive(&mut p, t0).len(), 1);
    // Stopped for five stall windows, then woken that late: the gap is the pull's own.
    let late = t0 + stall * 5;
    p.paused(stall * 5);
    p.handle(late, Event::Wake).unwrap();
    while let Some(c) = p.poll(late).unwrap() {
        assert!(!matches!(c, Command::GiveUp { .. }), "{c:?}");
    }
    // The source still sends nothing for a whole window after: given up then.
    p.handle(late + stall, Event::Wake).unwrap();
    let mut gave_up = false;
    while let Some(c) = p.poll(late + stall).unwrap() {
        gave_up |= matches!(c, Command::GiveUp { .. });
    }
    assert!(gave_up);
}

/// An attachment runs beside the pull: events that come before its answer (a wake, the list,
/// a fetch's end) issue no command, in particular no second attachment; a chunk the source
/// must serve again while another member is being attached goes back to be dealt, and is dealt
/// once the answer comes.
#[test]
fn events_while_an_attachment_runs_issue_no_second_attachment() {
    let now = Instant::now();
    let mut p = source_only(4, 2);
    let fetches = drive(&mut p, now);
    assert_eq!(fetches.len(), 2);
    // The source is no longer attached (as if given up and listed again) and another member's
    // attachment is running when chunk 0's bytes turn out wrong.
    p.holders.remove("src");
    p.attaching = Some(member("b", Role::Receiver));
    p.handle(now, fetched(0, fetches[0].2, Outcome::Mismatch))
        .unwrap();
    p.handle(now, Event::Wake).unwrap();
    let mut out = Vec::new();
    while let Some(c) = p.poll(now).unwrap() {
        out.push(c);
    }
    assert!(
        out.iter()
            .all(|c| matches!(c, Command::Publish | Command::Heartbeat)),
        "{out:?}"
    );
    assert_eq!(p.attaching.as_ref().map(|m| m.id.as_str()), Some("b"));
    assert!(p.refetch.is_empty(), "dealt again, not kept for b");
    // The answer: the pull goes on, and chunk 0 is asked for again (from the source).
    p.handle(now, Event::AttachFailed("test".into())).unwrap();
    let again = drive(&mut p, now);
    assert!(
        again.iter().any(|(c, h, _)| *c == 0 && h == "src"),
        "{again:?}"
    );
}
