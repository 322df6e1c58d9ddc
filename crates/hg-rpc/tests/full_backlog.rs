//! A caller that stops reading its responses: the target's send backlog
//! to it fills, and the target must neither grow it past its bound nor
//! leave the caller's calls without an answer. Each response the backlog
//! refuses is answered in its place while there is room for that: a
//! handler's output by the short `ResponseNotSent` error, an answer from
//! no handler (busy) by itself again. Two engines in one test process
//! over real sm plugins (and a raw NA endpoint as the silent caller),
//! each driven by hand.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc, RpcError};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{call_both, client, dir, endpoint, wire_message};

const T: Duration = Duration::from_secs(10);

/// A caller that sends requests and never reads the responses (it posts no
/// receive; its ring to us fills) cannot make the target queue responses
/// without bound: past the plugin's send-backlog bound each further
/// response is refused (the plugin's `sends_refused`) and the short
/// `ResponseNotSent` error tried in its place (counted in
/// `responses_replaced` if the backlog had room for it, else the response
/// is dropped: `responses_dropped`, and one more refusal), every request
/// is still handled, the queued bytes stay under the bound, and an honest
/// caller is served meanwhile.
#[test]
fn a_caller_that_never_reads_cannot_grow_the_targets_send_backlog() {
    use hg_rpc::codec::{Codec, Postcard};
    use hg_rpc::header::FLAG_CHECKSUM;
    use na_core::{Endpoint, NaError, OpId, Plugin, ProgressMode};
    use na_sm::{SmConfig, SmPlugin};

    const BOUND: usize = 1 << 20;
    const REQUESTS: u64 = 1000;
    let d = dir("unread");
    let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
    let cfg = SmConfig {
        max_backlog_bytes: BOUND,
        ..SmConfig::listening()
    }
    .with_dir(&*d);
    let sid = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<Echo>(Ok).unwrap();
    let uri = srv.self_addr().uri().to_owned();

    // The silent caller: raw requests for `Echo` of 4000 bytes.
    let (mut raw, _) = endpoint(&d, false);
    let s = raw.lookup(&uri).unwrap();
    let mut payload = Vec::new();
    Postcard.encode(&vec![7u8; 4000], &mut payload).unwrap();
    let req = wire_message(FLAG_CHECKSUM, Echo::NAME, 1, &payload);
    let end = Instant::now() + T;
    for i in 0..REQUESTS {
        loop {
            assert!(Instant::now() < end, "request {i} not sent: {:?}", srv.stats());
            match raw.send_unexpected(&s, 0, &req, OpId(i)) {
                Ok(()) => break,
                // Our own bound (the target is slower than us): it reads on.
                Err(NaError::SendBacklogFull { .. }) => {}
                Err(e) => panic!("send {i}: {}", na_core::ErrorChain(&e)),
            }
            raw.progress(Some(Duration::ZERO)).unwrap();
            srv.progress(Some(Duration::ZERO)).unwrap();
            srv.trigger().unwrap();
        }
        raw.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::ZERO)).unwrap();
        srv.trigger().unwrap();
    }
    let end = Instant::now() + T;
    while srv.stats().handled < REQUESTS {
        assert!(Instant::now() < end, "the server handled {:?}", srv.stats());
        raw.progress(Some(Duration::ZERO)).unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
    }
    let st = srv.stats();
    let na = srv.endpoint().plugin(sid).unwrap().stats();
    // 1000 responses of ~4 KiB are ~4 MiB: the silent caller takes in a
    // few hundred (its held-message bound and ring), 1 MiB more queue,
    // and the rest are refused; each response is one of the three. Each
    // one refused was replaced by the error (sent or queued), or dropped
    // (the error refused too).
    assert!(st.responses_dropped > 0, "{st:?} {na:?}");
    let (replaced, dropped) = (st.responses_replaced, st.responses_dropped);
    assert_eq!(na.sends_refused, replaced + 2 * dropped, "{st:?} {na:?}");
    assert_eq!(
        na.msgs_sent + na.sends_queued + na.sends_refused,
        REQUESTS + replaced + dropped,
        "{st:?} {na:?}"
    );
    assert!(na.backlog_bytes > 0 && na.backlog_bytes <= BOUND as u64, "{na:?}");

    // An honest caller is answered while the silent one still holds its share.
    let mut c = client(&d);
    assert_eq!(
        call_both::<Echo>(&mut c, &mut srv, &ByteBuf::from(vec![1, 2, 3])).unwrap(),
        vec![1, 2, 3]
    );
    drop(raw);
}

/// A server whose send backlog holds `bound` bytes per peer, with `Echo`,
/// and a client with its address: the set-up of the tests of a caller
/// that stops reading.
fn backlogged(d: &std::path::Path, bound: usize) -> (Engine, Engine, hg_rpc::Addr) {
    let mut srv = common::backlog_engine(d, true, bound);
    srv.register::<Echo>(Ok).unwrap();
    let mut c = client(d);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    (srv, c, s)
}

/// Drives `srv` until it handled `n` requests in all, while the caller
/// `c` moves its own sends but takes no message in.
fn serve_unread(c: &mut Engine, srv: &mut Engine, n: u64) {
    let end = Instant::now() + T;
    while srv.stats().handled < n {
        assert!(Instant::now() < end, "the server handled {:?}", srv.stats());
        c.progress_now().unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
    }
}

/// A caller that stopped reading, calling with no deadline: each response
/// the target's full send backlog refuses is answered by the short
/// `ResponseNotSent` error in its place while the backlog has room for
/// that, so once the caller reads again each of those calls ends with it
/// (before: it waited for ever); the rest end with their output, but the
/// ones whose error was refused too (counted as dropped), which the
/// target could not tell.
#[test]
fn a_response_refused_by_a_full_backlog_is_replaced_by_response_not_sent() {
    const CALLS: usize = 600;
    let d = dir("replaced");
    let (mut srv, mut c, s) = backlogged(&d, 10 << 10);
    let ids: Vec<_> = (0..CALLS)
        .map(|_| c.forward::<Echo>(&s, &ByteBuf::from(vec![7u8; 4000])).unwrap())
        .collect();
    serve_unread(&mut c, &mut srv, CALLS as u64);
    let st = srv.stats();
    assert!(
        st.responses_replaced > 0,
        "no error went in a response's place: {st:?}"
    );
    // It reads again: every call but the dropped ones ends.
    let (mut ok, mut not_sent) = (0, 0);
    let mut open = ids;
    let end = Instant::now() + T;
    while ok + not_sent + (st.responses_dropped as usize) < CALLS {
        assert!(
            Instant::now() < end,
            "{ok} answered and {not_sent} told, of {CALLS}: {st:?}; client {:?}",
            c.stats()
        );
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        open.retain(|&id| match c.take_response::<Echo>(id) {
            None => true,
            Some(Ok(out)) => {
                assert_eq!(out.len(), 4000);
                ok += 1;
                false
            }
            Some(Err(RpcError::ResponseNotSent { reason, .. })) => {
                assert!(reason.contains("already queued"), "{reason}");
                not_sent += 1;
                false
            }
            Some(Err(e)) => panic!("a call ended with {}", na_core::ErrorChain(&e)),
        });
    }
    assert_eq!(not_sent as u64, st.responses_replaced, "{st:?}");
    assert_eq!(srv.stats().responses_replaced, st.responses_replaced);
}

/// Bytes a sm send backlog charges for a queued message of `len` bytes
/// (`na_core::QUEUED_SEND_OVERHEAD` more).
const QUEUED: usize = 64;

/// The length of the `Echo` output whose response a backlog charges
/// `charge` bytes: the header, the output's length prefix (postcard: one
/// byte below 128, two below 16384) and the output. (Charges under 97,
/// and 225, have none.)
fn echo_len_charged(charge: usize) -> usize {
    let fixed = hg_rpc::header::HEADER_LEN + QUEUED;
    if charge <= fixed + 1 + 127 {
        charge - fixed - 1
    } else {
        charge - fixed - 2
    }
}

// The most bytes of reason what goes again in a lost answer's place
// carries (the engine's own value, not a copy a change of it would leave
// stale): an answer from no handler whose reason is no longer is not
// tried again when a full backlog refused it (the same message would be
// refused again).
use hg_rpc::engine::RESENT_REASON_MAX;

/// An answer from no handler (busy here: nothing ran, try later) that the
/// target's full send backlog refuses goes again with its status, its
/// reason cut short, and the caller's call ends with `Busy`, as a retry
/// policy keyed on it expects (before: `ResponseNotSent`, "the handler
/// may have run", and that error, longer than the busy answer, was
/// refused too here: the call got nothing at all). Whether it goes again
/// depends on the busy reason's length, which this test does not pick:
/// [`no_handler_answer_refused_by_a_full_backlog`] checks the outcome
/// either length has (the next test always has a long one).
#[test]
fn a_busy_answer_refused_by_a_full_backlog_still_arrives_as_busy() {
    no_handler_answer_refused_by_a_full_backlog::<Sleep>(
        "busy-refused",
        |srv| {
            srv.register_deferred::<Sleep>().unwrap();
            srv.set_max_deferred(0, 0);
        },
        &1,
        &2,
        |e| match e {
            RpcError::Busy { reason, .. } => Some(reason.clone()),
            _ => None,
        },
    );
}

/// An RPC whose name makes the reason of its decode error (which names
/// it) longer than [`RESENT_REASON_MAX`] whatever the rest of the text.
struct LongNamed;
impl Rpc for LongNamed {
    const NAME: &'static str = "long_named_rpc_whose_decode_error_reason_names_it_and_so_is_longer_than_what_goes_again_in_a_lost_answers_place";
    type Input = u64;
    type Output = u64;
}

/// [`LongNamed`] as a caller that sends no input at all: no `u64` decodes.
struct LongNamedNoInput;
impl Rpc for LongNamedNoInput {
    const NAME: &'static str = LongNamed::NAME;
    type Input = ();
    type Output = u64;
}

/// As above, with an answer from no handler whose reason is long by
/// construction (a decode error naming an RPC of a long name): it always
/// goes again, cut short, and the call ends with `Decode`, whatever the
/// length of the busy reason.
#[test]
fn a_long_decode_error_refused_by_a_full_backlog_goes_again_cut_short() {
    assert!(
        LongNamed::NAME.len() > RESENT_REASON_MAX,
        "LongNamed's name ({} bytes) must be longer than the engine's RESENT_REASON_MAX ({RESENT_REASON_MAX}): lengthen it",
        LongNamed::NAME.len()
    );

    no_handler_answer_refused_by_a_full_backlog::<LongNamedNoInput>(
        "decode-refused",
        |srv| srv.register::<LongNamed>(Ok).unwrap(),
        &(),
        &(),
        |e| match e {
            RpcError::Decode { reason, .. } => Some(reason.clone()),
            _ => None,
        },
    );
}

/// A server that answers a call of `R` from no handler (`setup` makes it
/// so; `reason_of` takes that answer's reason from the caller's error, or
/// `None` for another error): its answer to `probe` while the caller
/// reads tells its reason and so its length; then the caller stops
/// reading, the backlog is filled to leave exactly one byte less room
/// than that answer takes, and `input` is called. The answer is refused;
/// if its reason is longer than [`RESENT_REASON_MAX`], the same answer cut
/// to it goes in its place (`responses_replaced`) and the call ends with
/// it once the caller reads again; else it is not tried again (the same
/// message would be refused), the answer is dropped
/// (`responses_dropped`) and the call gets nothing.
fn no_handler_answer_refused_by_a_full_backlog<R: Rpc>(
    tag: &str,
    setup: impl FnOnce(&mut Engine),
    probe: &R::Input,
    input: &R::Input,
    reason_of: impl Fn(&RpcError) -> Option<String>,
) {
    const BOUND: usize = 10 << 10;
    let d = dir(tag);
    let (mut srv, mut c, s) = backlogged(&d, BOUND);
    setup(&mut srv);
    let sid = srv.endpoint().plugin_ids().next().unwrap();
    let backlog = |srv: &mut Engine| srv.endpoint().plugin(sid).unwrap().stats().backlog_bytes as usize;
    // The answer while the caller reads: what it says, and so its length.
    let probe = match call_both::<R>(&mut c, &mut srv, probe) {
        Err(e) => reason_of(&e).unwrap_or_else(|| panic!("not the expected answer: {e:?}")),
        Ok(_) => panic!("the probe succeeded"),
    };
    let charge = hg_rpc::header::HEADER_LEN + probe.len() + QUEUED;
    let cut = probe.len() > RESENT_REASON_MAX;

    // The caller stops reading: outputs of 3000 bytes fill its ring until
    // one is queued, then outputs of chosen lengths leave the room the
    // answer needs less one byte.
    let mut calls = Vec::new();
    let mut handled = srv.stats().handled;
    while backlog(&mut srv) == 0 {
        assert!(calls.len() < 10_000, "nothing queued: {:?}", srv.stats());
        calls.push(c.forward::<Echo>(&s, &ByteBuf::from(vec![7u8; 3000])).unwrap());
        handled += 1;
        serve_unread(&mut c, &mut srv, handled);
    }
    let target = charge - 1;
    loop {
        let queued = backlog(&mut srv);
        let gap = (BOUND - queued)
            .checked_sub(target)
            .expect("the room left is already under the answer's");
        if gap == 0 {
            break;
        }
        // What one output can take exactly leaves 0, or 97 to 224 bytes.
        let charge = match gap {
            97..=224 => gap,
            _ if gap > 3098 + 224 => 3098,
            _ if gap < 247 => gap - 100,
            _ if gap - 150 == 225 => 224,
            _ => gap - 150,
        };
        calls.push(
            c.forward::<Echo>(&s, &ByteBuf::from(vec![7u8; echo_len_charged(charge)]))
                .unwrap(),
        );
        handled += 1;
        serve_unread(&mut c, &mut srv, handled);
        assert_eq!(backlog(&mut srv), queued + charge, "queued {queued}, gap {gap}");
    }

    // The answer does not fit; what goes in its place (if anything) does.
    let before = srv.stats();
    let refused = srv.endpoint().plugin(sid).unwrap().stats().sends_refused;
    let lost = c.forward::<R>(&s, input).unwrap();
    serve_unread(&mut c, &mut srv, handled + 1);
    let st = srv.stats();
    let na = srv.endpoint().plugin(sid).unwrap().stats();
    assert_eq!(
        na.sends_refused,
        refused + 1,
        "refused: the answer (once) and what went in its place (never; cut: {cut}): {na:?}"
    );
    let (replaced, dropped) = if cut { (1, 0) } else { (0, 1) };
    assert_eq!(
        (st.responses_replaced, st.responses_dropped),
        (
            before.responses_replaced + replaced,
            before.responses_dropped + dropped
        ),
        "a reason of {} bytes (cut: {cut}): {st:?}",
        probe.len()
    );

    // The caller reads again: its outputs, then the answer (if it went).
    let mut open = calls;
    let mut outcome: Option<hg_rpc::Result<R::Output>> = None;
    let end = Instant::now() + T;
    while !open.is_empty() || (cut && outcome.is_none()) {
        assert!(
            Instant::now() < end,
            "{} calls open, the lost answer's: {:?}",
            open.len(),
            outcome.as_ref().map(|r| r.as_ref().map(|_| ()))
        );
        for e in [&mut c, &mut srv] {
            e.progress(Some(Duration::from_millis(1))).unwrap();
            e.trigger().unwrap();
        }
        open.retain(|&id| match c.take_response::<Echo>(id) {
            None => true,
            Some(r) => {
                assert!(r.is_ok(), "an Echo call ended with {r:?}");
                false
            }
        });
        outcome = outcome.or_else(|| c.take_response::<R>(lost));
    }
    if !cut {
        // Nothing went: the call still waits, once all that was sent
        // before has been read, and a while after.
        let end = Instant::now() + Duration::from_millis(300);
        while outcome.is_none() && Instant::now() < end {
            for e in [&mut c, &mut srv] {
                e.progress(Some(Duration::from_millis(1))).unwrap();
                e.trigger().unwrap();
            }
            outcome = c.take_response::<R>(lost);
        }
        assert!(
            outcome.is_none(),
            "a dropped answer arrived: {:?}",
            outcome.map(|r| r.map(|_| ()))
        );
        c.abandon(lost);
        return;
    }
    match outcome {
        Some(Err(e)) => {
            let reason = reason_of(&e).unwrap_or_else(|| panic!("the lost answer arrived as {e:?}"));
            assert!(reason.len() <= RESENT_REASON_MAX, "not cut: {reason}");
            assert!(reason.len() < probe.len(), "not cut: {reason}");
            let head = &probe[..RESENT_REASON_MAX / 2];
            assert!(reason.starts_with(head), "{reason} (first: {probe})");
        }
        other => panic!("the lost answer arrived as {:?}", other.map(|r| r.map(|_| ()))),
    }
}
