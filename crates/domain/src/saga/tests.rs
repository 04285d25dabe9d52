//! The saga's decision table walked pair by pair, and random fact sequences against a model
//! of the ledger that refuses every move the status tables do not list.

use super::*;
use proptest::prelude::*;
use uuid::Uuid;

const PI: &str = "pi_current";
const OTHER_PI: &str = "pi_other";

/// The ledger rows one order's facts can touch, moved only by executing steps.
#[derive(Clone, Debug)]
struct World {
    order: OrderStatus,
    hold: HoldSnapshot,
    payment: Option<PaymentIntentStatus>,
    cancel_requested: bool,
    confirmed_live: Vec<bool>,
    emitted: Vec<EventKind>,
}

impl World {
    fn new(order: OrderStatus, hold: HoldStatus, lapsed: bool) -> Self {
        World {
            order,
            hold: HoldSnapshot { id: HoldId(Uuid::nil()), status: hold, lapsed },
            payment: Some(PaymentIntentStatus::RequiresPaymentMethod),
            cancel_requested: false,
            confirmed_live: vec![],
            emitted: vec![],
        }
    }

    fn snapshot(&self, pi: &str) -> Snapshot {
        Snapshot {
            order: self.order,
            amount_minor: 18_500,
            hold: Some(self.hold),
            intent: if self.payment.is_none() {
                IntentMatch::Unrecorded
            } else if pi == PI {
                IntentMatch::Current
            } else {
                IntentMatch::Other
            },
            payment: self.payment.clone(),
            dispute_policy: DisputePolicy::Keep,
            capture_request: CaptureRequest::default(),
        }
    }

    /// Executes `steps` as the store would, panicking on any illegal write.
    fn execute(&mut self, steps: &[Step], pi: &str) {
        for step in steps {
            match step {
                Step::MoveHold(to) => self.move_hold(*to),
                Step::ExpireHold => self.expire_hold(),
                Step::MoveOrder { to, .. } => {
                    if *to == OrderStatus::Confirming {
                        self.confirmed_live.push(self.hold.status == HoldStatus::Confirmed);
                    }
                    self.move_order(*to)
                }
                Step::MirrorPayment(u) => {
                    if let (true, Some(p)) = (pi == PI, &self.payment) {
                        assert!(p.can_transition_to(&u.status), "illegal payment write {p} -> {}", u.status);
                        self.payment = Some(u.status.clone());
                    }
                }
                Step::RecordDecline { .. } => {
                    if pi == PI && self.payment.as_ref().is_some_and(|p| p.is_unsettled()) {
                        self.payment = Some(PaymentIntentStatus::RequiresPaymentMethod);
                    }
                }
                Step::CancelAuthorization { payment_intent_id, .. } => {
                    if let (true, Some(payment)) = (payment_intent_id == PI, &self.payment) {
                        if !self.cancel_requested && !payment.is_final() {
                            self.cancel_requested = true;
                            self.emitted.push(EventKind::AuthorizationCancelRequested);
                        }
                    } else {
                        self.emitted.push(EventKind::AuthorizationCancelRequested);
                    }
                }
                Step::Emit(e) => self.emitted.push(e.kind()),
                Step::VoidTickets { .. } => {
                    assert_eq!(
                        self.order,
                        OrderStatus::Refunded,
                        "tickets are voided only with the order refunded"
                    );
                    self.emitted.push(EventKind::TicketsVoided);
                }
                Step::MirrorDispute { .. } | Step::FlagTicketsDisputed | Step::RestoreDisputedTickets => {}
                Step::SetCaptureBefore(_) | Step::Incident { .. } | Step::Count(_) => {}
            }
        }
    }

    fn move_hold(&mut self, to: HoldStatus) {
        assert!(self.hold.status.can_transition_to(to), "illegal hold write {} -> {to}", self.hold.status);
        assert!(to != HoldStatus::Confirmed || !self.hold.lapsed, "a lapsed hold was confirmed");
        self.hold.status = to;
    }

    fn move_order(&mut self, to: OrderStatus) {
        assert!(self.order.can_transition_to(to), "illegal order write {} -> {to}", self.order);
        self.order = to;
    }

    /// The lapsed-hold compensation, as the store's expiry applies it.
    fn expire_hold(&mut self) {
        self.move_hold(HoldStatus::Expired);
        if lapsed_hold_expires_order(self.order) {
            self.move_order(OrderStatus::Expired);
        }
        if self.payment.as_ref().is_some_and(|p| !p.is_final()) && !self.cancel_requested {
            self.cancel_requested = true;
            self.emitted.push(EventKind::AuthorizationCancelRequested);
        }
        self.emitted.push(EventKind::HoldExpired);
    }

    /// One fact through the saga.
    fn apply(&mut self, fact: &PurchaseEvent) {
        let pi = fact.payment_intent_id().unwrap_or(PI);
        let steps = decide(&self.snapshot(pi), fact).expect("the saga takes every fact of a held order");
        self.execute(&steps, pi);
    }
}

fn fact(kind: EventKind, pi: &str) -> PurchaseEvent {
    let order_id = OrderId(Uuid::nil());
    let pi = pi.to_owned();
    match kind {
        EventKind::HoldCreated => PurchaseEvent::HoldCreated {
            order_id,
            hold_id: HoldId(Uuid::nil()),
            event_id: crate::EventId(Uuid::nil()),
            seat_ids: vec![],
            expires_at: Utc::now(),
            amount_minor: 18_500,
            currency: "usd".into(),
            // A fact of a writer from before `hold_created`: the saga requests the authorization.
            authorization_requested: false,
            is_authorization_request: false,
        },
        EventKind::PaymentIntentCreated => PurchaseEvent::PaymentIntentCreated {
            order_id,
            payment_intent_id: pi,
            status: PaymentIntentStatus::RequiresPaymentMethod,
        },
        EventKind::PaymentAuthorized => PurchaseEvent::PaymentAuthorized {
            order_id,
            payment_intent_id: pi,
            amount_capturable_minor: 18_500,
            capture_before: None,
        },
        EventKind::PaymentFailed => {
            PurchaseEvent::PaymentFailed { order_id, payment_intent_id: pi, reason: "card_declined".into() }
        }
        EventKind::PaymentCaptured => {
            PurchaseEvent::PaymentCaptured { order_id, payment_intent_id: pi, amount_captured_minor: 18_500 }
        }
        EventKind::CaptureFailed => {
            PurchaseEvent::CaptureFailed { order_id, payment_intent_id: pi, reason: "expired".into() }
        }
        EventKind::PaymentCanceled => PurchaseEvent::PaymentCanceled { order_id, payment_intent_id: pi },
        EventKind::PaymentRefunded => {
            PurchaseEvent::PaymentRefunded { order_id, payment_intent_id: pi, amount_refunded_minor: 18_500 }
        }
        EventKind::PaymentDisputed => PurchaseEvent::PaymentDisputed {
            order_id,
            payment_intent_id: pi,
            dispute_id: "dp_1".into(),
            status: "lost".into(),
        },
        other => panic!("{other} is not a saga fact"),
    }
}

/// The hold a consistent ledger has beside an order in `status` (live where it may be).
fn hold_beside(status: OrderStatus) -> HoldStatus {
    use OrderStatus::*;
    match status {
        Held | PaymentRequired | Authorized => HoldStatus::Active,
        Confirming | Paid => HoldStatus::Confirmed,
        Ticketed | Failed => HoldStatus::Released,
        Expired | Canceled | Refunding | Refunded => HoldStatus::Expired,
    }
}

/// Every (order status, fact) pair with a live hold and the order's own PaymentIntent: the
/// order's status after the saga acted, or `-` for unchanged.
#[test]
fn every_state_and_fact_pair_has_its_outcome() {
    use OrderStatus::*;
    //                       held        payment_req  authorized  confirming paid      ticketed expired     failed      canceled    refunding refunded
    let table: [(EventKind, [&str; 11]); 9] = [
        (EventKind::HoldCreated, ["-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]),
        (
            EventKind::PaymentIntentCreated,
            ["payment_required", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"],
        ),
        (
            EventKind::PaymentAuthorized,
            ["confirming", "confirming", "confirming", "-", "-", "-", "canceled", "canceled", "-", "-", "-"],
        ),
        (EventKind::PaymentFailed, ["-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-"]),
        (
            EventKind::PaymentCaptured,
            [
                "refunding",
                "refunding",
                "refunding",
                "paid",
                "-",
                "-",
                "refunding",
                "refunding",
                "refunding",
                "-",
                "-",
            ],
        ),
        (EventKind::CaptureFailed, ["-", "-", "-", "failed", "-", "-", "-", "-", "-", "-", "-"]),
        (
            EventKind::PaymentCanceled,
            ["canceled", "canceled", "canceled", "failed", "-", "-", "-", "-", "-", "-", "-"],
        ),
        (EventKind::PaymentRefunded, ["-", "-", "-", "-", "-", "refunded", "-", "-", "-", "refunded", "-"]),
        // A lost dispute.
        (EventKind::PaymentDisputed, ["-", "-", "-", "-", "-", "refunded", "-", "-", "-", "-", "-"]),
    ];
    assert_eq!(table.len(), FACTS.len());
    for (kind, row) in table {
        for (from, expected) in OrderStatus::ALL.into_iter().zip(row) {
            let mut w = World::new(from, hold_beside(from), false);
            if from == Refunding || from == Refunded || from == Paid || from == Ticketed {
                w.payment = Some(PaymentIntentStatus::Succeeded);
            }
            if matches!(from, Confirming) {
                w.payment = Some(PaymentIntentStatus::RequiresCapture);
            }
            if kind == EventKind::PaymentCanceled && w.payment == Some(PaymentIntentStatus::Succeeded) {
                continue; // Stripe cannot cancel a captured PaymentIntent.
            }
            w.apply(&fact(kind, PI));
            let got = if w.order == from { "-" } else { w.order.as_str() };
            assert_eq!(got, expected, "{kind} on a {from} order");
        }
    }
}

#[test]
fn an_authorization_confirms_only_a_live_hold_of_its_own_intent() {
    for from in [OrderStatus::Held, OrderStatus::PaymentRequired] {
        // Lapsed (expiry has not run yet): the hold expires, the order ends canceled.
        let mut w = World::new(from, HoldStatus::Active, true);
        w.apply(&fact(EventKind::PaymentAuthorized, PI));
        assert_eq!((w.order, w.hold.status), (OrderStatus::Canceled, HoldStatus::Expired));
        assert!(w.emitted.contains(&EventKind::HoldExpired));
        assert_eq!(w.emitted.iter().filter(|k| **k == EventKind::AuthorizationCancelRequested).count(), 1);

        // Another PaymentIntent's authorization: cancelled, the order untouched.
        let mut w = World::new(from, HoldStatus::Active, false);
        w.apply(&fact(EventKind::PaymentAuthorized, OTHER_PI));
        assert_eq!((w.order, w.hold.status), (from, HoldStatus::Active));
        assert_eq!(w.emitted, vec![EventKind::AuthorizationCancelRequested]);

        // Not recorded yet (the webhook overtook the payment worker): accepted as the order's.
        let mut w = World::new(from, HoldStatus::Active, false);
        w.payment = None;
        w.apply(&fact(EventKind::PaymentAuthorized, PI));
        assert_eq!(w.order, OrderStatus::Confirming);
    }
}

/// Case C09's deadline is recorded in the write that confirms: a confirmed authorization's
/// payment update carries the provider's capture deadline when the fact states one, else the
/// default (kept when one is recorded), and no second write does it; an authorization that is
/// not confirmed (late, or another intent's) still records a stated deadline on its own.
#[test]
fn a_confirmed_authorization_records_its_capture_deadline_with_the_payment_status() {
    let at = Utc::now() + chrono::Duration::days(6);
    let authorized = |pi: &str, capture_before| PurchaseEvent::PaymentAuthorized {
        order_id: OrderId(Uuid::nil()),
        payment_intent_id: pi.into(),
        amount_capturable_minor: 18_500,
        capture_before,
    };
    let mirrors = |steps: &[Step]| -> Vec<CaptureDeadline> {
        steps
            .iter()
            .filter_map(|s| match s {
                Step::MirrorPayment(u) => Some(u.capture_before),
                _ => None,
            })
            .collect()
    };
    let separate = |steps: &[Step]| steps.iter().filter(|s| matches!(s, Step::SetCaptureBefore(_))).count();
    for (stated, want) in [(Some(at), CaptureDeadline::Known(at)), (None, CaptureDeadline::DefaultIfUnknown)]
    {
        let w = World::new(OrderStatus::PaymentRequired, HoldStatus::Active, false);
        let steps = decide(&w.snapshot(PI), &authorized(PI, stated)).unwrap();
        assert!(steps.contains(&Step::MoveHold(HoldStatus::Confirmed)), "{steps:?}");
        assert_eq!(mirrors(&steps), vec![want], "{steps:?}");
        assert_eq!(separate(&steps), 0, "one write: {steps:?}");
    }
    // Not confirmed: the stated deadline alone, in its own step; no default invented.
    for (lapsed, pi) in [(true, PI), (false, OTHER_PI)] {
        let w = World::new(OrderStatus::PaymentRequired, HoldStatus::Active, lapsed);
        let steps = decide(&w.snapshot(pi), &authorized(pi, Some(at))).unwrap();
        assert!(!steps.contains(&Step::MoveHold(HoldStatus::Confirmed)), "{steps:?}");
        assert_eq!(separate(&steps), 1, "{steps:?}");
        assert!(mirrors(&steps).iter().all(|d| *d == CaptureDeadline::Keep), "{steps:?}");
        let steps = decide(&w.snapshot(pi), &authorized(pi, None)).unwrap();
        assert_eq!(separate(&steps), 0, "{steps:?}");
        assert!(mirrors(&steps).iter().all(|d| *d == CaptureDeadline::Keep), "{steps:?}");
    }
}

/// Invariant 6 for money on a stray PaymentIntent: a capture of another intent of the order
/// (an authorization captured elsewhere, e.g. from the dashboard) is refunded, whatever the
/// order's status, and neither it nor that refund moves the order, its hold or its tickets.
#[test]
fn a_stray_intents_capture_is_refunded_and_moves_nothing() {
    for from in OrderStatus::ALL {
        let mut w = World::new(from, hold_beside(from), false);
        w.payment = Some(if from == OrderStatus::Confirming {
            PaymentIntentStatus::RequiresCapture
        } else {
            PaymentIntentStatus::Succeeded
        });
        let hold = w.hold.status;
        w.apply(&fact(EventKind::PaymentCaptured, OTHER_PI));
        assert_eq!((w.order, w.hold.status), (from, hold), "capture of another intent on a {from} order");
        assert_eq!(w.emitted, vec![EventKind::RefundRequested], "{from}");
        let steps = decide(&w.snapshot(OTHER_PI), &fact(EventKind::PaymentCaptured, OTHER_PI)).unwrap();
        assert!(
            steps
                .iter()
                .any(|s| matches!(s, Step::Emit(PurchaseEvent::RefundRequested { payment_intent_id, .. })
                if payment_intent_id == OTHER_PI)),
            "the refund is of the stray intent"
        );
        w.apply(&fact(EventKind::PaymentRefunded, OTHER_PI));
        assert_eq!((w.order, w.hold.status), (from, hold), "refund of another intent on a {from} order");
    }
}

/// The cancel of a stray authorization (which the saga itself asks for) is not the order's:
/// a `confirming` order keeps its confirmed hold and goes on to capture its own PaymentIntent,
/// and an unpaid order stays payable.
#[test]
fn a_stray_intents_cancel_moves_nothing() {
    for from in OrderStatus::ALL {
        let mut w = World::new(from, hold_beside(from), false);
        if from == OrderStatus::Confirming {
            w.payment = Some(PaymentIntentStatus::RequiresCapture);
        }
        let hold = w.hold.status;
        w.apply(&fact(EventKind::PaymentCanceled, OTHER_PI));
        assert_eq!((w.order, w.hold.status), (from, hold), "cancel of another intent on a {from} order");
        assert!(w.emitted.is_empty(), "{from}: {:?}", w.emitted);
    }
}

#[test]
fn a_confirmed_order_near_its_capture_deadline_is_given_up_once() {
    let mut w = World::new(OrderStatus::Confirming, HoldStatus::Confirmed, false);
    w.payment = Some(PaymentIntentStatus::RequiresCapture);
    let steps = give_up_before_capture_deadline(&w.snapshot(PI), PI);
    w.execute(&steps, PI);
    assert_eq!((w.order, w.hold.status), (OrderStatus::Failed, HoldStatus::Released));
    assert_eq!(w.emitted, vec![EventKind::AuthorizationCancelRequested]);
    assert!(give_up_before_capture_deadline(&w.snapshot(PI), PI).is_empty(), "once");
}

#[test]
fn commands_and_foreign_facts_are_refused() {
    let w = World::new(OrderStatus::Held, HoldStatus::Active, false);
    let cmd =
        PurchaseEvent::TicketIssueRequested { order_id: OrderId(Uuid::nil()), hold_id: HoldId(Uuid::nil()) };
    assert_eq!(decide(&w.snapshot(PI), &cmd), Err(Refusal::NotASagaFact(EventKind::TicketIssueRequested)));
    let mut s = w.snapshot(PI);
    s.hold = None;
    assert_eq!(decide(&s, &fact(EventKind::PaymentAuthorized, PI)).unwrap_err().code(), "missing_hold");
}

/// What can happen to one order between two facts, besides the saga's own steps.
#[derive(Clone, Debug)]
enum Event {
    /// A saga fact about the order's PaymentIntent (or another one).
    Fact(EventKind, bool),
    /// Time passes beyond the hold's expiry.
    Lapse,
    /// The expiry worker's sweep.
    ExpirySweep,
    /// The ticket worker issues tickets for a paid order.
    IssueTickets,
    /// The capture-deadline sweep (case C09).
    DeadlineSweep,
}

fn any_event() -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0..FACTS.len(), proptest::bool::weighted(0.85)).prop_map(|(i, own)| Event::Fact(FACTS[i], own)),
        1 => Just(Event::Lapse),
        1 => Just(Event::ExpirySweep),
        1 => Just(Event::IssueTickets),
        1 => Just(Event::DeadlineSweep),
    ]
}

/// Whether Stripe could report `kind` for a PaymentIntent now mirrored as `p`: nothing follows
/// a cancellation but a restated cancellation, and a captured intent is never cancelled.
fn provider_could_report(kind: EventKind, p: Option<&PaymentIntentStatus>) -> bool {
    match (kind, p) {
        (EventKind::PaymentCaptured | EventKind::PaymentRefunded, Some(PaymentIntentStatus::Canceled)) => {
            false
        }
        (EventKind::PaymentCanceled, Some(PaymentIntentStatus::Succeeded)) => false,
        (EventKind::PaymentRefunded | EventKind::PaymentDisputed, Some(p)) => {
            *p == PaymentIntentStatus::Succeeded
        }
        (EventKind::PaymentDisputed, None) => false,
        _ => true,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Random histories (duplicates, reordering, stray intents, lapses, sweeps): no illegal
    /// status is ever written (the world panics on one), and every confirmation happened with
    /// a hold the saga had just confirmed from active (invariant 2).
    #[test]
    fn random_fact_sequences_never_write_an_illegal_status(events in proptest::collection::vec(any_event(), 1..40)) {
        let mut w = World::new(OrderStatus::Held, HoldStatus::Active, false);
        w.payment = None;
        for e in events {
            match e {
                Event::Fact(kind, own) => {
                    let pi = if own { PI } else { OTHER_PI };
                    if own && !provider_could_report(kind, w.payment.as_ref()) {
                        continue;
                    }
                    if own && kind == EventKind::PaymentIntentCreated && w.payment.is_none() {
                        w.payment = Some(PaymentIntentStatus::RequiresPaymentMethod);
                    }
                    w.apply(&fact(kind, pi));
                }
                Event::Lapse => w.hold.lapsed = true,
                Event::ExpirySweep => {
                    if w.hold.status == HoldStatus::Active && w.hold.lapsed {
                        w.expire_hold();
                    }
                }
                Event::IssueTickets => {
                    if w.order == OrderStatus::Paid && w.hold.status == HoldStatus::Confirmed {
                        w.move_hold(HoldStatus::Released);
                        w.move_order(OrderStatus::Ticketed);
                    }
                }
                Event::DeadlineSweep => {
                    let steps = give_up_before_capture_deadline(&w.snapshot(PI), PI);
                    w.execute(&steps, PI);
                }
            }
            prop_assert!(w.confirmed_live.iter().all(|c| *c));
            if w.hold.status == HoldStatus::Confirmed {
                prop_assert!(matches!(w.order, OrderStatus::Confirming | OrderStatus::Paid));
            }
        }
    }
}

/// The hold transaction's facts start the saga by themselves: its `HoldCreated` is the
/// authorization request (or, in the command form, the request follows it), and the saga
/// leaves it alone; one written without the request (an older writer's) still gets it from
/// the saga, once per `held` order.
#[test]
fn the_hold_transaction_requests_the_authorization_itself() {
    use crate::saga::AuthorizationRequest;
    let (order_id, hold_id) = (OrderId(Uuid::new_v4()), HoldId(Uuid::new_v4()));
    let facts = |form| {
        crate::saga::hold_created(
            order_id,
            hold_id,
            crate::EventId(Uuid::new_v4()),
            vec![],
            Utc::now(),
            18_500,
            "usd".into(),
            form,
        )
    };
    let ask = crate::AuthorizationAsk { order_id, hold_id, amount_minor: 18_500, currency: "usd" };
    let [created] = facts(AuthorizationRequest::InHoldFact).try_into().expect("one fact");
    assert_eq!(created.authorization_request(), Some(ask), "the fact is the request");
    // An older build's saga, which knows only `authorization_requested`, requests it itself.
    assert!(matches!(created, PurchaseEvent::HoldCreated { authorization_requested: false, .. }));
    assert!(!crate::saga::acts_on(&created), "the saga skips a HoldCreated that is the request");
    let [beside, request] = facts(AuthorizationRequest::Command).try_into().expect("two facts");
    assert_eq!(
        request,
        PurchaseEvent::PaymentAuthorizationRequested {
            order_id,
            hold_id,
            amount_minor: 18_500,
            currency: "usd".into()
        }
    );
    assert_eq!(request.authorization_request(), Some(ask));
    assert_eq!(beside.authorization_request(), None, "the command is the request, not the fact beside it");
    assert!(!crate::saga::acts_on(&beside), "the saga skips a HoldCreated that came with its request");
    let held = World::new(OrderStatus::Held, HoldStatus::Active, false);
    assert_eq!(decide(&held.snapshot(PI), &beside).unwrap(), vec![]);
    assert_eq!(decide(&held.snapshot(PI), &created).unwrap(), vec![]);
    let older = fact(EventKind::HoldCreated, PI);
    assert!(crate::saga::acts_on(&older));
    assert_eq!(older.authorization_request(), None);
    let steps = decide(&held.snapshot(PI), &older).unwrap();
    assert!(
        matches!(steps.as_slice(), [Step::Emit(PurchaseEvent::PaymentAuthorizationRequested { .. })]),
        "{steps:?}"
    );
    let paying = World::new(OrderStatus::PaymentRequired, HoldStatus::Active, false);
    assert_eq!(
        decide(&paying.snapshot(PI), &older).unwrap(),
        vec![],
        "an order past `held` is not asked again"
    );
}

/// A confirmation asks for its capture once, in either form: in the default form its
/// `OrderConfirmed` is the request (for the order's PaymentIntent and total); in the command
/// form a `CaptureRequested` with the same terms follows an `OrderConfirmed` that is not one.
/// Only `PaymentAuthorized` with a live hold writes either.
#[test]
fn a_confirmation_requests_the_capture_once_in_either_form() {
    let live = World::new(OrderStatus::PaymentRequired, HoldStatus::Active, false);
    let authorized = fact(EventKind::PaymentAuthorized, PI);
    let order_id = authorized.order_id();
    let ask = crate::CaptureAsk { order_id, payment_intent_id: PI, amount_minor: 18_500 };
    let emitted = |form| {
        let snapshot = Snapshot { capture_request: form, ..live.snapshot(PI) };
        decide(&snapshot, &authorized)
            .unwrap()
            .into_iter()
            .filter_map(|step| match step {
                Step::Emit(e) => Some(e),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let [confirmed] = emitted(CaptureRequest::InConfirmationFact).try_into().expect("one fact");
    assert!(matches!(confirmed, PurchaseEvent::OrderConfirmed { .. }), "{confirmed:?}");
    assert_eq!(confirmed.capture_request(), Some(ask), "the fact is the request");
    assert_eq!(confirmed.payment_intent_id(), Some(PI));
    let [beside, request] = emitted(CaptureRequest::Command).try_into().expect("two facts");
    assert!(matches!(beside, PurchaseEvent::OrderConfirmed { capture: None, .. }), "{beside:?}");
    assert_eq!(beside.capture_request(), None, "the command is the request, not the fact beside it");
    assert_eq!(
        request,
        PurchaseEvent::CaptureRequested { order_id, payment_intent_id: PI.into(), amount_minor: 18_500 }
    );
    assert_eq!(request.capture_request(), Some(ask));
    // An older writer's fact (no `capture` field) reads as one that is not the request, and
    // this build writes no `capture` field on such a fact.
    let written = serde_json::to_value(&beside).unwrap();
    assert!(written["payload"].get("capture").is_none(), "{written}");
    let older = serde_json::json!({
        "event_type": "OrderConfirmed",
        "payload": { "order_id": order_id, "hold_id": written["payload"]["hold_id"] },
    });
    assert_eq!(serde_json::from_value::<PurchaseEvent>(older).unwrap(), beside);
    // Neither form is written twice: a confirmed order decides nothing on a second authorization.
    let confirming = World::new(OrderStatus::Confirming, HoldStatus::Confirmed, false);
    for form in [CaptureRequest::InConfirmationFact, CaptureRequest::Command] {
        let snapshot = Snapshot { capture_request: form, ..confirming.snapshot(PI) };
        assert_eq!(decide(&snapshot, &authorized).unwrap(), vec![], "{form:?}");
    }
}
