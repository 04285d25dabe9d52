//! Latency statistics shared by the drills and the tests: the one histogram shape every
//! latency is recorded in (µs, 1 µs .. 1 h, 3 significant digits, `hdrhistogram`), its
//! quantiles in ms, the [`Percentiles`] that reports carry, and nearest-rank percentiles of
//! plain samples (time series such as sampled outbox ages).
//!
//! Recording never fails the caller: a latency above the histogram's hour is dropped, one
//! below 1 µs counts as 1 µs.

use hdrhistogram::Histogram;
use serde::Serialize;
use std::time::Duration;

/// A latency histogram in µs, 1 µs .. 1 h, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

/// Records `elapsed` in µs (at least 1 µs; a value beyond the histogram's bound is dropped).
pub fn record(h: &mut Histogram<u64>, elapsed: Duration) {
    let _ = h.record((elapsed.as_micros() as u64).max(1));
}

/// `(p50, p99, max)` of a µs histogram, in ms; zeros when it is empty.
pub fn quantiles_ms(h: &Histogram<u64>) -> (f64, f64, f64) {
    if h.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    let ms = |v: u64| v as f64 / 1_000.0;
    (ms(h.value_at_quantile(0.5)), ms(h.value_at_quantile(0.99)), ms(h.max()))
}

/// Latency percentiles in ms over `count` samples (all zero when there are none).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Percentiles {
    /// Median, ms.
    pub p50: f64,
    /// 95th percentile, ms.
    pub p95: f64,
    /// 99th percentile, ms.
    pub p99: f64,
    /// Maximum, ms.
    pub max: f64,
    /// Number of samples.
    pub count: u64,
}

impl Percentiles {
    /// Reads a histogram recorded in µs.
    pub fn from_us(h: &Histogram<u64>) -> Self {
        let ms = |us: u64| us as f64 / 1_000.0;
        Self {
            p50: ms(h.value_at_quantile(0.50)),
            p95: ms(h.value_at_quantile(0.95)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
            count: h.len(),
        }
    }
}

/// Nearest-rank percentile of `v` (unsorted), `q` in 0..=1; 0 when empty.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_percentiles() {
        let mut h = histogram();
        assert_eq!(quantiles_ms(&h), (0.0, 0.0, 0.0));
        for ms in 1..=100 {
            record(&mut h, Duration::from_millis(ms));
        }
        record(&mut h, Duration::ZERO);
        let (p50, p99, max) = quantiles_ms(&h);
        assert!((49.0..=51.0).contains(&p50) && (98.0..=100.1).contains(&p99), "{p50} {p99}");
        assert!((99.9..=100.1).contains(&max));
        assert_eq!(Percentiles::from_us(&h).count, 101);
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 0.5), 2.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0, 4.0], 0.99), 4.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
