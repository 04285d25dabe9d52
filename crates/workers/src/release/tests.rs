//! The control law, exhaustively: bounds, the direction of every step, the hold zone, failed
//! probes, convergence to max, and a simulated episode in which a signal climbs towards its
//! threshold and R falls before the signal crosses it.

use super::*;
use proptest::prelude::*;

fn limits() -> Limits {
    Limits { min_per_s: 2.0, max_per_s: 100.0, step_per_s: 10.0, decrease_factor: 0.5, soft_fraction: 0.8 }
}

#[test]
fn healthy_signals_increase_by_the_step_up_to_max() {
    let (t, l) = (Thresholds::default(), limits());
    let d = next_rate(10.0, &Signals::zero(), &t, &l);
    assert_eq!((d.rate, d.action), (20.0, Action::Increase));
    assert!(d.over.is_empty() && d.failed.is_empty() && d.soft.is_empty());
    assert_eq!(next_rate(95.0, &Signals::zero(), &t, &l).rate, 100.0);
    assert_eq!(next_rate(100.0, &Signals::zero(), &t, &l).rate, 100.0);
}

#[test]
fn a_signal_over_its_threshold_halves_the_rate_and_is_the_reason() {
    let (t, l) = (Thresholds::default(), limits());
    let s = Signals::zero().with(Signal::OutboxAgeMs, Reading::Value(t.outbox_age_ms + 1.0));
    let d = next_rate(80.0, &s, &t, &l);
    assert_eq!((d.rate, d.action), (40.0, Action::Decrease));
    assert_eq!(d.over, vec![Signal::OutboxAgeMs]);
    // Down to min, never below.
    assert_eq!(next_rate(3.0, &s, &t, &l).rate, 2.0);
    assert_eq!(next_rate(2.0, &s, &t, &l).rate, 2.0);
}

#[test]
fn exactly_at_the_threshold_is_not_over_but_is_in_the_soft_zone() {
    let (t, l) = (Thresholds::default(), limits());
    let s = Signals::zero().with(Signal::LockWaits, Reading::Value(t.lock_waits));
    let d = next_rate(30.0, &s, &t, &l);
    assert_eq!((d.rate, d.action, d.soft.clone()), (30.0, Action::Hold, vec![Signal::LockWaits]));
}

#[test]
fn the_soft_zone_holds_the_rate() {
    let (t, l) = (Thresholds::default(), limits());
    let s = Signals::zero().with(Signal::PgCommitMs, Reading::Value(t.pg_commit_ms * 0.9));
    let d = next_rate(30.0, &s, &t, &l);
    assert_eq!((d.rate, d.action), (30.0, Action::Hold));
    // Just under the soft zone: healthy.
    let s = Signals::zero().with(Signal::PgCommitMs, Reading::Value(t.pg_commit_ms * 0.79));
    assert_eq!(next_rate(30.0, &s, &t, &l).action, Action::Increase);
}

#[test]
fn a_failed_probe_decreases_and_is_reported_apart() {
    let (t, l) = (Thresholds::default(), limits());
    let s = Signals::zero().with(Signal::ConsumerLag, Reading::Failed);
    let d = next_rate(40.0, &s, &t, &l);
    assert_eq!((d.rate, d.action), (20.0, Action::Decrease));
    assert_eq!((d.failed, d.over), (vec![Signal::ConsumerLag], vec![]));
    let nan = Signals::zero().with(Signal::PgCommitMs, Reading::Value(f64::NAN));
    assert_eq!(next_rate(40.0, &nan, &t, &l).failed, vec![Signal::PgCommitMs]);
}

#[test]
fn signals_that_are_off_are_ignored() {
    let (t, l) = (Thresholds::default(), limits());
    let d = next_rate(10.0, &Signals::default(), &t, &l);
    assert_eq!((d.rate, d.action), (20.0, Action::Increase));
}

#[test]
fn any_deadlock_is_over_a_zero_threshold() {
    let (t, l) = (Thresholds::default(), limits());
    assert_eq!(t.deadlocks, 0.0);
    let s = Signals::zero().with(Signal::Deadlocks, Reading::Value(1.0));
    assert_eq!(next_rate(10.0, &s, &t, &l).over, vec![Signal::Deadlocks]);
    assert_eq!(next_rate(10.0, &Signals::zero(), &t, &l).action, Action::Increase);
}

#[test]
fn over_beats_soft_and_every_offender_is_named() {
    let (t, l) = (Thresholds::default(), limits());
    let s = Signals::zero()
        .with(Signal::ActiveHolds, Reading::Value(t.active_holds * 0.9))
        .with(Signal::ExpiryDelayMs, Reading::Value(t.expiry_delay_ms * 2.0))
        .with(Signal::ConnectionSaturation, Reading::Value(0.99));
    let d = next_rate(50.0, &s, &t, &l);
    assert_eq!(d.action, Action::Decrease);
    assert_eq!(d.over, vec![Signal::ConnectionSaturation, Signal::ExpiryDelayMs]);
    assert_eq!(d.soft, vec![Signal::ActiveHolds]);
}

#[test]
fn out_of_range_or_nonsense_rates_are_clamped_first() {
    let (t, l) = (Thresholds::default(), limits());
    assert_eq!(next_rate(1e9, &Signals::zero(), &t, &l).rate, 100.0);
    assert_eq!(next_rate(-5.0, &Signals::zero(), &t, &l).rate, 12.0);
    assert_eq!(next_rate(f64::NAN, &Signals::zero(), &t, &l).rate, 12.0);
    assert_eq!(next_rate(f64::INFINITY, &Signals::zero(), &t, &l).rate, 12.0);
}

/// A simulated onsale: the outbox age rises with R (the relay's headroom shrinks as R
/// grows past what it drains). R climbs, the age enters its soft zone and R stops growing
/// before the age ever crosses its threshold; a burst pushes it over, R falls, and once the
/// burst passes R climbs back to max.
#[test]
fn simulated_episode_falls_before_the_threshold_and_recovers() {
    let t = Thresholds { outbox_age_ms: 1_000.0, ..Thresholds::default() };
    let l = limits();
    // Age grows with R: 10 ms per position/s.
    let age = |r: f64| r * 10.0;
    let mut r = l.min_per_s;
    let mut max_age_seen: f64 = 0.0;
    for _ in 0..100 {
        let a = age(r);
        max_age_seen = max_age_seen.max(a);
        r = next_rate(r, &Signals::zero().with(Signal::OutboxAgeMs, Reading::Value(a)), &t, &l).rate;
    }
    assert!(max_age_seen <= t.outbox_age_ms, "the age crossed its threshold: {max_age_seen}");
    assert!(age(r) > t.outbox_age_ms * l.soft_fraction, "R settled in the soft zone: {r}");
    // A burst: the relay stalls for 3 ticks and the age jumps by 5 s.
    let before = r;
    for _ in 0..3 {
        let burst = Signals::zero().with(Signal::OutboxAgeMs, Reading::Value(age(r) + 5_000.0));
        r = next_rate(r, &burst, &t, &l).rate;
    }
    assert!(r < before / 2.0, "R fell: {before} → {r}");
    // The cause goes away entirely: R recovers to max.
    for _ in 0..20 {
        r = next_rate(r, &Signals::zero(), &t, &l).rate;
    }
    assert_eq!(r, l.max_per_s);
}

fn reading() -> impl Strategy<Value = Reading> {
    prop_oneof![
        3 => (0.0f64..200_000.0).prop_map(Reading::Value),
        1 => Just(Reading::Failed),
        1 => Just(Reading::Off),
    ]
}

fn signals() -> impl Strategy<Value = Signals> {
    proptest::array::uniform11(reading()).prop_map(Signals)
}

fn any_limits() -> impl Strategy<Value = Limits> {
    (0.1f64..50.0, 0.0f64..500.0, 0.01f64..50.0, 0.05f64..0.95, 0.1f64..=1.0).prop_map(
        |(min, span, step, factor, soft)| Limits {
            min_per_s: min,
            max_per_s: min + span,
            step_per_s: step,
            decrease_factor: factor,
            soft_fraction: soft,
        },
    )
}

fn any_thresholds() -> impl Strategy<Value = Thresholds> {
    proptest::array::uniform11(0.0f64..100_000.0).prop_map(|t| Thresholds {
        pg_commit_ms: t[0],
        lock_waits: t[1],
        deadlocks: t[2],
        connection_saturation: t[3],
        outbox_age_ms: t[4],
        consumer_lag: t[5],
        active_holds: t[6],
        expiry_delay_ms: t[7],
        payable_delay_ms: t[8],
        authorization_wait_ms: t[9],
        never_payable_share: t[10],
    })
}

proptest! {
    /// R always stays within [min, max], whatever it was and whatever the signals say.
    #[test]
    fn rate_stays_within_bounds(r in -1e6f64..1e6, s in signals(), t in any_thresholds(), l in any_limits()) {
        let d = next_rate(r, &s, &t, &l);
        prop_assert!(d.rate >= l.min_per_s && d.rate <= l.max_per_s, "{} not in [{}, {}]", d.rate, l.min_per_s, l.max_per_s);
    }

    /// A signal over its threshold (or a failed probe) never increases R, and is named.
    #[test]
    fn over_threshold_never_increases(
        r in 0.0f64..1_000.0, s in signals(), t in any_thresholds(), l in any_limits(), which in 0usize..8, excess in 0.001f64..1e5,
    ) {
        let sig = Signal::ALL[which];
        let s = s.with(sig, Reading::Value(t.of(sig) + excess));
        let start = r.clamp(l.min_per_s, l.max_per_s);
        let d = next_rate(r, &s, &t, &l);
        prop_assert_eq!(d.action, Action::Decrease);
        prop_assert!(d.rate <= start);
        prop_assert!(d.over.contains(&sig));
    }

    /// With every signal healthy, R reaches max within ⌈(max − min) / step⌉ ticks and stays.
    #[test]
    fn healthy_long_enough_climbs_to_max(r in 0.0f64..1_000.0, t in any_thresholds(), l in any_limits()) {
        let healthy = Signals::zero();
        let ticks = ((l.max_per_s - l.min_per_s) / l.step_per_s).ceil() as usize + 1;
        let mut rate = r;
        for _ in 0..ticks {
            let d = next_rate(rate, &healthy, &t, &l);
            prop_assert!(d.rate >= rate.clamp(l.min_per_s, l.max_per_s));
            rate = d.rate;
        }
        prop_assert_eq!(rate, l.max_per_s);
    }

    /// A decrease is multiplicative: R·factor, or min.
    #[test]
    fn decrease_is_by_the_factor(r in 0.0f64..1_000.0, l in any_limits(), t in any_thresholds()) {
        let s = Signals::zero().with(Signal::PgCommitMs, Reading::Failed);
        let start = r.clamp(l.min_per_s, l.max_per_s);
        let d = next_rate(r, &s, &t, &l);
        prop_assert_eq!(d.rate, (start * l.decrease_factor).max(l.min_per_s));
    }
}
