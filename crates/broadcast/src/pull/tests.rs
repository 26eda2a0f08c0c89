//! The pull's rules, event by event, with no sockets.

use super::*;

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
