//! The ring host against a fake ring: what a test completes is all that completes.

use std::cell::RefCell;
use std::net::{TcpListener, TcpStream};
use std::rc::Rc;

use super::*;
use crate::ring::fake::Fake;
use crate::ring::user_data::GENERATION_MASK;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Recv,
    Zc,
}

impl OpKind for Op {
    fn kind(self) -> u8 {
        match self {
            Op::Recv => 1,
            Op::Zc => 2,
        }
    }

    fn of(kind: u8) -> Option<Self> {
        match kind {
            1 => Some(Op::Recv),
            2 => Some(Op::Zc),
            _ => None,
        }
    }
}

#[derive(Debug, PartialEq)]
enum Event {
    Advanced(&'static str),
    Completed(&'static str, Op, i32),
    Ending(&'static str),
    Ended(&'static str, Option<i32>),
}

type Log = Rc<RefCell<Vec<Event>>>;

/// What a test stream does when it advances.
#[derive(Clone, Copy)]
enum Plan {
    /// Queues one receive (while none is in flight).
    Recv,
    /// Queues one zero-copy send holding the hold given.
    Zc,
    Yield,
    End,
}

struct Test {
    name: &'static str,
    socket: Arc<TcpStream>,
    log: Log,
    plan: Plan,
    inflight: bool,
    hold: Option<Arc<()>>,
}

impl Stream for Test {
    type Op = Op;
    type Hold = Arc<()>;
    type Error = i32;
    const ZC_SENT: Op = Op::Zc;

    fn socket(&self) -> &Arc<TcpStream> {
        &self.socket
    }

    fn advance(&mut self, io: &mut Io<'_, Arc<()>>) -> Turn<i32> {
        self.log.borrow_mut().push(Event::Advanced(self.name));
        match self.plan {
            Plan::Recv | Plan::Zc if self.inflight => Turn::Wait,
            Plan::Recv => {
                self.inflight = true;
                // SAFETY: a no-op carries no pointer (the fake runs nothing anyway).
                unsafe { io.push(Op::Recv, opcode::Nop::new().build()) }.unwrap();
                Turn::Wait
            }
            Plan::Zc => {
                self.inflight = true;
                let hold = self.hold.clone().unwrap();
                // SAFETY: as above.
                unsafe { io.push_zc(opcode::Nop::new().build(), hold) }.unwrap();
                Turn::Wait
            }
            Plan::Yield => Turn::Yield,
            Plan::End => Turn::End(None),
        }
    }

    fn complete(&mut self, op: Op, res: i32, _flags: u32) -> Result<(), i32> {
        self.inflight = false;
        self.log
            .borrow_mut()
            .push(Event::Completed(self.name, op, res));
        if res < 0 { Err(-res) } else { Ok(()) }
    }

    fn ending(&mut self) {
        self.log.borrow_mut().push(Event::Ending(self.name));
    }

    fn end(self: Box<Self>, why: Option<i32>) {
        self.log.borrow_mut().push(Event::Ended(self.name, why));
    }
}

/// A connected loopback socket (the other end dropped: nothing is ever read from it).
fn socket() -> Arc<TcpStream> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    Arc::new(s)
}

fn host() -> (Host<Test, Fake>, Inbox<()>, Log) {
    let inbox = Inbox::new().unwrap();
    let wake = Arc::new(EventFd::new().unwrap());
    let h = Host::new(Fake::default(), wake, Arc::new(IoStats::default()));
    (h, inbox, Rc::default())
}

fn stream(name: &'static str, log: &Log, plan: Plan) -> Box<Test> {
    Box::new(Test {
        name,
        socket: socket(),
        log: log.clone(),
        plan,
        inflight: false,
        hold: None,
    })
}

/// A freed slot is taken again by the next stream, under the next generation: a completion
/// named for the stream that left never reaches the one that came.
#[test]
fn a_freed_slot_is_reused_and_a_late_completion_does_not_reach_its_new_stream() {
    let (mut h, inbox, log) = host();
    let a = h.add(stream("a", &log, Plan::Recv)).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    let a_op = h.ring.ops()[0];
    // A zero-copy send queued by "a" reaches it as its own; its user data names slot and
    // generation.
    assert_eq!(
        user_data::decode(a_op),
        Decoded::Op {
            kind: 1,
            slot: a,
            generation: 1
        }
    );
    h.end(a, Some(5));
    assert_eq!(
        log.borrow().last(),
        Some(&Event::Ending("a")),
        "a stream with an operation in flight went before it completed"
    );
    h.ring.complete(a_op, 0, 0);
    h.turn(&inbox, None).unwrap();
    assert!(log.borrow().contains(&Event::Ended("a", Some(5))));
    assert!(
        !log.borrow()
            .iter()
            .any(|e| matches!(e, Event::Completed(..))),
        "an ending stream was handed a completion"
    );
    let b = h.add(stream("b", &log, Plan::Recv)).ok().unwrap();
    assert_eq!(b, a, "the freed slot was not reused");
    assert_eq!(h.slots[b].generation, 2);
    h.turn(&inbox, None).unwrap();
    // A completion of the first stream's generation, late (a duplicate, say): not b's.
    h.ring.done.push_back((a_op, 0, 0));
    h.turn(&inbox, None).unwrap();
    assert!(
        !log.borrow()
            .iter()
            .any(|e| matches!(e, Event::Completed("b", ..))),
        "a completion of the slot's last stream reached its new one"
    );
    let b_op = h.ring.ops()[0];
    h.ring.complete(b_op, 7, 0);
    h.turn(&inbox, None).unwrap();
    assert!(log.borrow().contains(&Event::Completed("b", Op::Recv, 7)));
}

/// Generations wrap within their bits; a stream at generation 0 after the wrap gets its
/// completions, and one of the generation before it does not.
#[test]
fn generations_wrap_and_a_completion_of_the_last_before_the_wrap_is_dropped() {
    let (mut h, inbox, log) = host();
    let a = h.add(stream("a", &log, Plan::End)).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    assert!(log.borrow().contains(&Event::Ended("a", None)));
    h.slots[a].generation = GENERATION_MASK;
    let b = h.add(stream("b", &log, Plan::Recv)).ok().unwrap();
    assert_eq!((b, h.slots[b].generation), (a, 0));
    h.turn(&inbox, None).unwrap();
    let op = h.ring.ops()[0];
    assert_eq!(
        user_data::decode(op),
        Decoded::Op {
            kind: 1,
            slot: b,
            generation: 0
        }
    );
    h.ring
        .done
        .push_back((user_data::op(1, b, GENERATION_MASK), 1, 0));
    h.ring.complete(op, 2, 0);
    h.turn(&inbox, None).unwrap();
    let got: Vec<_> = log
        .borrow()
        .iter()
        .filter_map(|e| match e {
            Event::Completed(n, _, r) => Some((*n, *r)),
            _ => None,
        })
        .collect();
    assert_eq!(got, [("b", 2)]);
}

/// The shutdown ends every stream (each socket shut down) and frees each only once the kernel
/// completed its operations; one whose operation never completes is never freed.
#[test]
fn shutdown_waits_for_operations_in_flight_and_frees_no_stream_the_kernel_may_write() {
    let (mut h, inbox, log) = host();
    h.add(stream("a", &log, Plan::Recv)).ok().unwrap();
    h.add(stream("b", &log, Plan::End)).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    assert!(log.borrow().contains(&Event::Ended("b", None)));
    h.ring.cancel_on_wait = true;
    h.shutdown();
    let log_a: Vec<_> = log
        .borrow()
        .iter()
        .filter(|e| !matches!(e, Event::Advanced(_)))
        .filter(|e| format!("{e:?}").contains("\"a\""))
        .map(|e| format!("{e:?}"))
        .collect();
    assert_eq!(log_a, ["Ending(\"a\")", "Ended(\"a\", None)"]);
    assert!(h.ring.files.is_empty(), "fixed files left registered");
    assert!(!h.wake_armed, "the wake read was left in flight");

    // A ring whose operation never completes gives up, and leaks the stream.
    let (mut h, inbox, log) = host();
    h.give_up = Duration::from_millis(50);
    h.add(stream("c", &log, Plan::Recv)).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    h.shutdown();
    assert!(
        !log.borrow().iter().any(|e| matches!(e, Event::Ended(..))),
        "a stream the kernel may still write into was freed"
    );
}

/// A zero-copy send's completion reaches its stream, its hold stays until the notification;
/// a stream that ends with holds outstanding leaves them held until the notification too.
#[test]
fn a_zero_copy_hold_is_kept_until_the_notification_even_past_its_stream() {
    let (mut h, inbox, log) = host();
    let hold = Arc::new(());
    let mut s = stream("a", &log, Plan::Zc);
    s.hold = Some(hold.clone());
    let a = h.add(s).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    let u = h.ring.submitted[h.ring.submitted.len() - 1];
    assert!(matches!(user_data::decode(u), Decoded::Zc(_)));
    assert_eq!(Arc::strong_count(&hold), 3);
    h.ring.complete(u, 4096, io_uring_more());
    h.turn(&inbox, None).unwrap();
    assert!(log.borrow().contains(&Event::Completed("a", Op::Zc, 4096)));
    h.end(a, None);
    assert!(log.borrow().contains(&Event::Ended("a", None)));
    assert_eq!(Arc::strong_count(&hold), 2, "the hold went with its stream");
    assert!(!h.is_empty(), "a host with a hold held says it is empty");
    h.ring.complete(u, 0, io_uring_notif());
    h.turn(&inbox, None).unwrap();
    assert_eq!(
        Arc::strong_count(&hold),
        1,
        "the notification did not drop the hold"
    );
    assert!(h.is_empty());
}

/// A stream that yields runs again at the next turn, and the ring does not sleep meanwhile.
#[test]
fn a_stream_that_yields_runs_again_without_a_wait() {
    let (mut h, inbox, log) = host();
    h.add(stream("a", &log, Plan::Yield)).ok().unwrap();
    h.turn(&inbox, None).unwrap();
    h.turn(&inbox, None).unwrap();
    assert_eq!(h.ring.waits, 0, "the ring slept with a stream to run");
    let runs = log
        .borrow()
        .iter()
        .filter(|e| **e == Event::Advanced("a"))
        .count();
    assert_eq!(runs, 2);
    // A stream woken from another thread keeps the ring awake too.
    h.slots[0].stream.as_mut().unwrap().plan = Plan::Recv;
    h.turn(&inbox, None).unwrap();
    inbox.wake(0);
    h.turn(&inbox, None).unwrap();
    assert_eq!(
        h.ring.waits, 1,
        "only the turn with nothing to do and nothing woken waits"
    );
}

/// `IORING_CQE_F_MORE`: a notification follows.
fn io_uring_more() -> u32 {
    1 << 1
}

/// `IORING_CQE_F_NOTIF`: the kernel let go of a zero-copy send's pages.
fn io_uring_notif() -> u32 {
    1 << 3
}
