//! Seat picking for the simulated buyers: turns one `GET /events/{id}/seats` snapshot into
//! rows of available seats and picks runs of adjacent seats (same section and row,
//! consecutive `number`s) at random, skipping seats the caller knows to be taken.
//!
//! The map is a hint, never a promise (design §1): a pick can still lose the hold race and
//! come back as a 409. Pure and synchronous: no IO, so it is unit-tested on its own.

use std::collections::BTreeMap;

use rand::Rng;
use serde::Deserialize;
use uuid::Uuid;

/// One seat as listed by `GET /events/{event_id}/seats` (fields the picker needs; the rest of
/// the JSON object is ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Seat {
    /// Seat id.
    pub seat_id: Uuid,
    /// Section name, e.g. `S104`.
    pub section: String,
    /// Row name within the section, e.g. `R12`.
    pub row: String,
    /// Seat number within the row; adjacent seats have consecutive numbers.
    pub number: i32,
    /// `available`, `held` or `sold`; only `available` seats can be picked.
    pub status: String,
}

/// Body of `GET /events/{event_id}/seats` (only `seats` is read).
#[derive(Debug, Deserialize)]
pub struct SeatMapBody {
    /// Every seat of the event with its status.
    pub seats: Vec<Seat>,
}

/// Available seats of one row, sorted by number.
#[derive(Debug)]
struct Row {
    seats: Vec<(i32, Uuid)>,
}

/// The available seats of one snapshot, grouped by (section, row). Rows without an available
/// seat are dropped, so picking near a sell-out only scans what is left.
#[derive(Debug, Default)]
pub struct SeatMap {
    rows: Vec<Row>,
    available: usize,
}

impl SeatMap {
    /// Builds the map from a seat listing; seats whose status is not `available` are dropped.
    pub fn from_seats(seats: impl IntoIterator<Item = Seat>) -> Self {
        let mut rows: BTreeMap<(String, String), Vec<(i32, Uuid)>> = BTreeMap::new();
        for s in seats.into_iter().filter(|s| s.status == "available") {
            rows.entry((s.section, s.row)).or_default().push((s.number, s.seat_id));
        }
        let rows: Vec<Row> = rows
            .into_values()
            .map(|mut seats| {
                seats.sort_unstable();
                Row { seats }
            })
            .collect();
        let available = rows.iter().map(|r| r.seats.len()).sum();
        Self { rows, available }
    }

    /// Number of seats listed as available in this snapshot.
    pub fn available(&self) -> usize {
        self.available
    }

    /// Picks `want` adjacent seats at a random row (and a random position within it), none
    /// of them `taken`. When no row has `want` adjacent free seats, asks for one fewer, down
    /// to a single seat, as a buyer who would rather sit apart than not go. Returns the seat
    /// ids in seat-number order, or `None` when no seat at all is free (sold out).
    pub fn pick<R: Rng + ?Sized>(
        &self,
        rng: &mut R,
        want: usize,
        taken: impl Fn(&Uuid) -> bool,
    ) -> Option<Vec<Uuid>> {
        if self.rows.is_empty() {
            return None;
        }
        let start = rng.gen_range(0..self.rows.len());
        for n in (1..=want.max(1)).rev() {
            for i in 0..self.rows.len() {
                let row = &self.rows[(start + i) % self.rows.len()];
                if let Some(seats) = pick_in_row(row, rng, n, &taken) {
                    return Some(seats);
                }
            }
        }
        None
    }
}

/// Picks one of the row's windows of `n` consecutive free seats uniformly, if any.
fn pick_in_row<R: Rng + ?Sized>(
    row: &Row,
    rng: &mut R,
    n: usize,
    taken: &impl Fn(&Uuid) -> bool,
) -> Option<Vec<Uuid>> {
    // Window start indexes into `row.seats`: a window is valid when its n seats are all free
    // and their numbers are consecutive.
    let mut starts = Vec::new();
    let mut run_start = 0;
    for (i, (number, id)) in row.seats.iter().enumerate() {
        if taken(id) {
            run_start = i + 1;
            continue;
        }
        if i > run_start && row.seats[i - 1].0 + 1 != *number {
            run_start = i;
        }
        if i + 1 - run_start >= n {
            starts.push(i + 1 - n);
        }
    }
    if starts.is_empty() {
        return None;
    }
    let s = starts[rng.gen_range(0..starts.len())];
    Some(row.seats[s..s + n].iter().map(|(_, id)| *id).collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;

    fn seat(section: &str, row: &str, number: i32, status: &str) -> Seat {
        Seat {
            seat_id: Uuid::new_v4(),
            section: section.into(),
            row: row.into(),
            number,
            status: status.into(),
        }
    }

    /// (section, row, number) of every seat id, to check what was picked.
    fn index(seats: &[Seat]) -> BTreeMap<Uuid, (String, String, i32)> {
        seats.iter().map(|s| (s.seat_id, (s.section.clone(), s.row.clone(), s.number))).collect()
    }

    fn assert_adjacent(picked: &[Uuid], idx: &BTreeMap<Uuid, (String, String, i32)>) {
        let first = &idx[&picked[0]];
        for (k, id) in picked.iter().enumerate() {
            let (section, row, number) = &idx[id];
            assert_eq!((section, row), (&first.0, &first.1), "same section and row");
            assert_eq!(*number, first.2 + k as i32, "consecutive numbers");
        }
    }

    #[test]
    fn picks_adjacent_seats_in_one_row() {
        let mut seats = Vec::new();
        for section in ["S1", "S2"] {
            for row in ["R1", "R2", "R3"] {
                // Listed out of order on purpose: the map sorts by number.
                for number in (1..=10).rev() {
                    seats.push(seat(section, row, number, "available"));
                }
            }
        }
        let idx = index(&seats);
        let map = SeatMap::from_seats(seats);
        assert_eq!(map.available(), 60);
        let mut rng = StdRng::seed_from_u64(7);
        for want in 1..=4 {
            for _ in 0..50 {
                let picked = map.pick(&mut rng, want, |_| false).expect("seats left");
                assert_eq!(picked.len(), want);
                assert_adjacent(&picked, &idx);
            }
        }
    }

    #[test]
    fn a_gap_in_numbers_breaks_adjacency() {
        // Seat 3 is sold: 1-2 and 4-5 are runs of two, there is no run of three.
        let seats: Vec<Seat> =
            (1..=5).map(|n| seat("S1", "R1", n, if n == 3 { "sold" } else { "available" })).collect();
        let idx = index(&seats);
        let map = SeatMap::from_seats(seats);
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..50 {
            let picked = map.pick(&mut rng, 2, |_| false).expect("two runs of two");
            assert_eq!(picked.len(), 2);
            assert_adjacent(&picked, &idx);
            // Asking for three falls back to two adjacent seats.
            let picked = map.pick(&mut rng, 3, |_| false).expect("falls back");
            assert_eq!(picked.len(), 2);
            assert_adjacent(&picked, &idx);
        }
    }

    #[test]
    fn skips_seats_known_taken() {
        let seats: Vec<Seat> = (1..=6).map(|n| seat("S1", "R1", n, "available")).collect();
        let idx = index(&seats);
        // Seats 2 and 4 were seen taken (e.g. in a 409): only 5-6 is a pair.
        let taken: HashSet<Uuid> =
            seats.iter().filter(|s| s.number == 2 || s.number == 4).map(|s| s.seat_id).collect();
        let map = SeatMap::from_seats(seats);
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..50 {
            let picked = map.pick(&mut rng, 2, |id| taken.contains(id)).expect("5-6");
            assert_eq!(picked.len(), 2);
            assert!(picked.iter().all(|id| !taken.contains(id)));
            assert_adjacent(&picked, &idx);
            assert_eq!(idx[&picked[0]].2, 5);
        }
    }

    #[test]
    fn sold_out_when_nothing_is_free() {
        let seats: Vec<Seat> =
            (1..=4).map(|n| seat("S1", "R1", n, if n % 2 == 0 { "held" } else { "sold" })).collect();
        let map = SeatMap::from_seats(seats);
        assert_eq!(map.available(), 0);
        let mut rng = StdRng::seed_from_u64(5);
        assert!(map.pick(&mut rng, 1, |_| false).is_none());

        // Available in the snapshot, but every seat known taken locally.
        let seats: Vec<Seat> = (1..=4).map(|n| seat("S1", "R1", n, "available")).collect();
        let map = SeatMap::from_seats(seats);
        assert!(map.pick(&mut rng, 2, |_| true).is_none());
        assert!(SeatMap::default().pick(&mut rng, 1, |_| false).is_none());
    }

    #[test]
    fn last_single_seat_is_found() {
        let mut seats: Vec<Seat> = Vec::new();
        for row in 1..=20 {
            for n in 1..=10 {
                seats.push(seat("S1", &format!("R{row}"), n, "sold"));
            }
        }
        seats.push(seat("S9", "R9", 42, "available"));
        let last = seats.last().map(|s| s.seat_id);
        let map = SeatMap::from_seats(seats);
        let mut rng = StdRng::seed_from_u64(11);
        assert_eq!(map.pick(&mut rng, 4, |_| false), last.map(|id| vec![id]));
    }
}
