//! The engine's unit tests: claims run against rows kept in memory.

use super::pages::{DEFAULT_PAGE_SIZE, MIN_OPEN_PAGE_SIZE};
use super::*;
use crate::claim::page::Page;
use crate::sql::Lower;
use crate::LockStrength;
use std::collections::{BTreeSet, HashMap, HashSet};

/// The plan of a claim of rows that are their own keys, per row, pages of
/// two keys, with row locks.
fn plan(drain: bool) -> Plan {
    Plan {
        clause: LockClause {
            strength: LockStrength::NoKeyUpdate,
            skip_locked: true,
            of: None,
        },
        taking: Taking::Select,
        row_locks: true,
        update_returning: true,
        grow_contended_pages: true,
        fail_on_locked: false,
        batch: 1,
        page_size: Some(2),
        drain,
        max_rows: None,
        ordered_by_key: true,
        keep_going: false,
        stop: None,
        in_worker: false,
        from_head: false,
        failed_again: false,
    }
}

/// A claim of [`plan`].
fn claim(drain: bool) -> Claim<i64> {
    Claim::new(plan(drain))
}

/// Other workers were seen claiming beside `claim`'s scan.
fn contended(claim: &Claim<i64>) -> bool {
    matches!(&claim.mode, Mode::Scan(scan) if scan.paging().contended)
}

/// Reads the page `keys` and claims every row offered until the page is done.
fn claim_page(claim: &mut Claim<i64>, keys: Vec<i64>) -> Vec<Lower<i64>> {
    let Step::Candidates(..) = claim.next() else {
        panic!("expected a candidate read");
    };
    let mut takes_from = Vec::new();
    claim.candidates(keys.clone());
    for key in keys {
        let Step::Batch(range, limit) = claim.next() else {
            panic!("expected a batch");
        };
        takes_from.push(range.lower);
        let rows = claim.taken(vec![key], limit, |row| *row).unwrap();
        claim.processed(rows.len());
    }
    takes_from
}

/// Rows between the end of one page and the first candidate of the next were
/// done when the page was read: the takes start at the candidate, rather than
/// step over them.
#[test]
fn takes_start_at_the_first_candidate_of_their_page() {
    for drain in [false, true] {
        let mut claim = claim(drain);
        let takes_from = claim_page(&mut claim, vec![1, 2]);
        assert!(
            matches!(takes_from[..], [Lower::From(1), Lower::After(1)]),
            "drain {drain}: {takes_from:?}"
        );
        // Rows 3 to 5 were claimed by someone else meanwhile.
        let takes_from = claim_page(&mut claim, vec![6, 7]);
        assert!(
            matches!(takes_from[..], [Lower::From(6), Lower::After(6)]),
            "drain {drain}: {takes_from:?}"
        );
    }
}

/// The keys of `pending` in `range`.
fn in_range<'a>(
    pending: &'a BTreeSet<i64>,
    range: &KeyRange<i64>,
) -> impl Iterator<Item = i64> + 'a {
    use std::ops::Bound;
    let lower = match range.lower {
        Lower::Unbounded => Bound::Unbounded,
        Lower::After(key) => Bound::Excluded(key),
        Lower::From(key) => Bound::Included(key),
    };
    let upper = range.through.map_or(Bound::Unbounded, Bound::Included);
    pending.range((lower, upper)).copied()
}

/// Runs `claim` to its end as a database would: `pending` rows match, of
/// which `held` are locked by others; a take gets the first `limit` rows
/// of its range that match and are not held, and processes them. Returns
/// the sizes of the pages read and where each take began.
fn run(
    claim: &mut Claim<i64>,
    pending: &mut BTreeSet<i64>,
    held: &HashSet<i64>,
) -> (Vec<i64>, Vec<Lower<i64>>) {
    let (mut pages, mut takes) = (Vec::new(), Vec::new());
    loop {
        match claim.next() {
            Step::Candidates(range, limit) => {
                pages.push(limit);
                claim.candidates(in_range(pending, &range).take(limit as usize).collect());
            }
            Step::StillMatching(range) => {
                claim.still_matching(in_range(pending, &range).collect());
            }
            Step::Batch(range, limit) => {
                let rows: Vec<i64> = in_range(pending, &range)
                    .filter(|key| !held.contains(key))
                    .take(limit as usize)
                    .collect();
                takes.push(range.lower);
                let rows = claim.taken(rows, limit, |row| *row).unwrap();
                for row in &rows {
                    pending.remove(row);
                }
                claim.processed(rows.len());
            }
            Step::Done => return (pages, takes),
        }
    }
}

/// A claim by key, per row, with row locks and the default pages.
fn default_claim(drain: bool) -> Claim<i64> {
    Claim::new(Plan {
        page_size: None,
        ..plan(drain)
    })
}

/// A drain retries the candidates it found locked as pages, each take
/// passing over as many rows as a batch holds, rather than one
/// transaction per row; rows of a retried page's range that the call
/// processed before and the closure left matching are not handed over
/// again.
#[test]
fn a_drain_retries_the_rows_it_found_locked_page_by_page() {
    let mut claim = Claim::new(Plan {
        batch: 10,
        page_size: None,
        ..plan(true)
    });
    let mut pending: BTreeSet<i64> = (1..=100).collect();
    // Held by other workers during the first pass.
    let held = |key: &i64| key % 2 == 0;
    // Left matching by the closure.
    let left_matching = |key: &i64| key % 10 == 1;
    let mut handed: HashMap<i64, u32> = HashMap::new();
    let mut takes_in_pass: HashMap<u32, u32> = HashMap::new();
    loop {
        match claim.next() {
            Step::Candidates(range, limit) => {
                claim.candidates(in_range(&pending, &range).take(limit as usize).collect());
            }
            Step::StillMatching(range) => {
                claim.still_matching(in_range(&pending, &range).collect());
            }
            Step::Batch(range, limit) => {
                let first_pass = claim.report().passes == 1;
                let rows: Vec<i64> = in_range(&pending, &range)
                    .filter(|key| !(first_pass && held(key)))
                    .take(limit as usize)
                    .collect();
                *takes_in_pass.entry(claim.report().passes).or_default() += 1;
                let rows = claim.taken(rows, limit, |row| *row).unwrap();
                for row in &rows {
                    *handed.entry(*row).or_default() += 1;
                    if !left_matching(row) {
                        pending.remove(row);
                    }
                }
                claim.processed(rows.len());
            }
            Step::Done => break,
        }
    }
    assert_eq!(handed.len(), 100, "every row handed over");
    assert!(handed.values().all(|times| *times == 1), "{handed:?}");
    assert_eq!(claim.report().processed, 100);
    // 50 rows retried in batches of 10: a few takes, not 50.
    let retry_takes = takes_in_pass[&2];
    assert!(retry_takes <= 10, "{retry_takes} takes retried 50 rows");
}

/// A page that starts further in is taken from there to its end, then from
/// its head to where it started, every candidate once.
#[test]
fn a_page_starting_further_in_is_taken_in_two_stretches() {
    let mut page = Page::new((1..=10).collect(), false, 4);
    assert!(matches!(
        page.next_range(),
        KeyRange {
            lower: Lower::From(5),
            through: Some(10),
            ..
        }
    ));
    page.record(vec![5, 6, 7], 3, true, false, |row| *row)
        .unwrap();
    assert!(matches!(
        page.next_range(),
        KeyRange {
            lower: Lower::After(7),
            through: Some(10),
            ..
        }
    ));
    // Row 9 is held by another worker.
    page.record(vec![8, 10], 3, true, false, |row| *row)
        .unwrap();
    assert!(matches!(
        page.next_range(),
        KeyRange {
            lower: Lower::From(1),
            through: Some(4),
            ..
        }
    ));
    assert!(!page.exhausted);
    page.record(vec![1, 2], 3, true, false, |row| *row).unwrap();
    assert!(page.exhausted);
    assert_eq!(page.passed_over().copied().collect::<Vec<_>>(), [9, 3, 4]);
    assert!(matches!(
        page.whole_range(),
        KeyRange {
            lower: Lower::From(1),
            through: Some(10),
            ..
        }
    ));
    assert_eq!(page.scanned_through(), 10);
}

/// A page left before its end passes over only what its takes went
/// through, in the order they went.
#[test]
fn a_page_left_early_passes_over_what_its_takes_went_through() {
    let mut page = Page::new((1..=10).collect(), false, 7);
    // Row 8 is held by another worker; rows 9 and 10 are taken.
    page.record(vec![9, 10], 2, true, false, |row| *row)
        .unwrap();
    assert_eq!(page.passed_over().copied().collect::<Vec<_>>(), [8]);
    assert_eq!(page.unprocessed().count(), 8);
}

/// Alone, a claim goes through its pages from their heads, in key order.
#[test]
fn a_claim_alone_takes_rows_in_key_order() {
    for drain in [false, true] {
        let mut claim = default_claim(drain);
        let mut pending = (1..=3000).collect();
        let (_, takes) = run(&mut claim, &mut pending, &HashSet::new());
        assert!(pending.is_empty());
        assert!(!contended(&claim), "drain {drain}");
        // Where each take could first find a row.
        let from: Vec<i64> = takes
            .iter()
            .map(|lower| match lower {
                Lower::From(key) => *key,
                Lower::After(key) => key + 1,
                Lower::Unbounded => i64::MIN,
            })
            .collect();
        assert_eq!(
            from[..3000],
            (1..=3000).collect::<Vec<_>>(),
            "drain {drain}"
        );
    }
}

/// Runs `claim` over 40,000 pending rows of which others hold the first
/// 50 and every row but one in eight: the claim is contended, leaves no
/// free row, and processes every free one. Returns `run`'s pages and takes;
/// the first page is the open-ended one.
fn run_among_others(claim: &mut Claim<i64>) -> (Vec<i64>, Vec<Lower<i64>>) {
    let held: HashSet<i64> = (1..=50)
        .chain((51..=40_000).filter(|key| key % 8 != 0))
        .collect();
    let mut pending: BTreeSet<i64> = (1..=40_000).collect();
    let (pages, takes) = run(claim, &mut pending, &held);
    assert!(contended(claim));
    assert!(
        pending.iter().all(|key| held.contains(key)),
        "a free row was left"
    );
    assert_eq!(claim.report().processed, 40_000 / 8 - 6);
    assert_eq!(pages[0], MIN_OPEN_PAGE_SIZE);
    (pages, takes)
}

/// Once a take has passed over rows others hold, the next pages start at
/// places of their own, grow while others take most of them, and still
/// offer every row that matches and is not held.
#[test]
fn a_contended_claim_spreads_out_over_its_pages() {
    let mut starts = HashSet::new();
    for _ in 0..3 {
        let mut claim = default_claim(false);
        let (pages, takes) = run_among_others(&mut claim);
        // The open-ended first page, then closed ones that grow.
        assert!(
            pages[1..].windows(2).all(|pair| pair[0] <= pair[1]),
            "{pages:?}"
        );
        assert!(pages[1] >= DEFAULT_PAGE_SIZE && pages[pages.len() - 1] > pages[1]);
        // The first page after the open-ended one starts where it will.
        starts.extend(takes.iter().find_map(|lower| match lower {
            Lower::From(key) if *key > 100 => Some(*key),
            _ => None,
        }));
    }
    assert!(
        starts.len() > 1,
        "every page started at its head: {starts:?}"
    );
}

/// On a backend whose contended pages do not grow (MySQL), the same
/// claim spreads out over pages of the default size, and still offers
/// every row that matches and is not held.
#[test]
fn a_contended_claim_keeps_its_page_size_where_pages_do_not_grow() {
    let mut claim = Claim::new(Plan {
        page_size: None,
        grow_contended_pages: false,
        ..plan(false)
    });
    let (pages, _) = run_among_others(&mut claim);
    assert!(
        pages[1..].iter().all(|&page| page == DEFAULT_PAGE_SIZE),
        "{pages:?}"
    );
}

/// A claim from the head: per row, with row locks, no pages.
fn head_claim(drain: bool) -> Claim<i64> {
    Claim::new(head_plan(drain))
}

/// The plan of a [`head_claim`].
fn head_plan(drain: bool) -> Plan {
    Plan {
        from_head: true,
        ..plan(drain)
    }
}

/// Runs a claim from the head as a database would, over `pending` rows in
/// key order: each take gets the first `limit` rows of its range that are
/// pending; `left_matching` rows stay pending once handed over. Returns the
/// rows handed over, in order.
fn run_from_head(
    claim: &mut Claim<i64>,
    pending: &mut BTreeSet<i64>,
    left_matching: impl Fn(i64) -> bool,
) -> Vec<i64> {
    let mut handed = Vec::new();
    loop {
        match claim.next() {
            Step::Batch(range, limit) => {
                assert!(matches!(range.lower, Lower::Unbounded) && range.through.is_none());
                let excluded: HashSet<i64> = range.excluded.iter().copied().collect();
                let rows: Vec<i64> = pending
                    .iter()
                    .copied()
                    .filter(|key| !excluded.contains(key))
                    .take(limit as usize)
                    .collect();
                let rows = claim.taken(rows, limit, |row| *row).unwrap();
                for &row in &rows {
                    if !left_matching(row) {
                        pending.remove(&row);
                    }
                }
                handed.extend(&rows);
                claim.processed(rows.len());
            }
            Step::Done => return handed,
            Step::Candidates(..) | Step::StillMatching(..) => {
                panic!("a claim from the head reads no pages")
            }
        }
    }
}

/// From the head, a row the closure leaves matching is met again by the
/// next take: it is not handed over twice, and is left out of the takes
/// from then on, so that the call goes on and ends.
#[test]
fn from_the_head_a_row_left_matching_is_handed_over_once() {
    for drain in [false, true] {
        let mut claim = head_claim(drain);
        let mut pending: BTreeSet<i64> = (1..=10).collect();
        let handed = run_from_head(&mut claim, &mut pending, |key| key % 3 == 0);
        assert_eq!(handed, (1..=10).collect::<Vec<_>>(), "drain {drain}");
        assert_eq!(claim.excluded, [3, 6, 9], "drain {drain}");
        assert_eq!(claim.report().processed, 10);
    }
}

/// From the head, a row enqueued ahead of the others is the next one taken.
#[test]
fn from_the_head_a_row_enqueued_ahead_is_taken_next() {
    let mut claim = head_claim(false);
    let mut pending: BTreeSet<i64> = (10..=12).collect();
    let Step::Batch(_, limit) = claim.next() else {
        panic!("expected a take");
    };
    let first = claim.taken(vec![10], limit, |row| *row).unwrap();
    pending.remove(&first[0]);
    claim.processed(1);
    // Enqueued ahead of 11 and 12 while 10 ran.
    pending.insert(5);
    let rest = run_from_head(&mut claim, &mut pending, |_| false);
    assert_eq!(rest, [5, 11, 12]);
}

/// A failed row is met again as any row handed over before, unless failed
/// rows may be handed over again (a worker without a backoff of its own).
#[test]
fn from_the_head_a_failed_row_comes_back_only_when_allowed() {
    for failed_again in [false, true] {
        let mut claim = Claim::new(Plan {
            failed_again,
            ..head_plan(false)
        });
        let Step::Batch(_, limit) = claim.next() else {
            panic!("expected a take");
        };
        let rows = claim.taken(vec![1], limit, |row| *row).unwrap();
        claim.failed(rows);
        let Step::Batch(..) = claim.next() else {
            panic!("expected a take");
        };
        let again = claim.taken(vec![1], limit, |row| *row).unwrap();
        assert_eq!(
            again.len(),
            usize::from(failed_again),
            "failed_again {failed_again}"
        );
        assert_eq!(claim.excluded.len(), usize::from(!failed_again));
    }
}

/// A call from the head that would leave out more than `MAX_EXCLUDED` rows
/// ends.
#[test]
fn from_the_head_a_call_ends_past_its_exclusions() {
    let mut claim = head_claim(true);
    claim.exclude(0..=MAX_EXCLUDED as i64);
    assert!(matches!(claim.next(), Step::Done));
}

/// Two loops of a pooled worker steer their takes from the head around each
/// other's batches: the first take is of the whole query; a take ahead of the
/// other's batch that comes back short is followed by one past it; takes
/// start past the last batch taken; a take past it that comes back short is
/// followed by a last look ahead; a look ahead that fills its batch looks on
/// after it; a last look that comes back short ends the run; and once two
/// looks have run out their ranges, looks start where the one before the
/// last ended.
#[test]
fn loops_on_a_pool_steer_around_each_others_batches() {
    let siblings = crate::claim::siblings::Siblings::new(2);
    let loop_claim = || {
        Claim::new(Plan {
            batch: 2,
            ..head_plan(false)
        })
    };
    let (mut a, mut b) = (loop_claim(), loop_claim());
    for (index, claim) in [&mut a, &mut b].into_iter().enumerate() {
        claim.beside(siblings.slot(index));
    }
    let take = |claim: &mut Claim<i64>| match claim.next() {
        Step::Batch(range, limit) => (range.lower, range.through, limit),
        _ => panic!("expected a take"),
    };
    let (lower, through, limit) = take(&mut a);
    assert!(matches!((lower, through), (Lower::Unbounded, None)));
    a.taken(vec![1, 2], limit, |row| *row).unwrap();
    // One take in each round of the two loops' looks ahead of the other's
    // batch, through its first row.
    let (lower, through, limit) = take(&mut b);
    assert!(matches!((lower, through), (Lower::Unbounded, Some(1))));
    assert!(b.taken(Vec::new(), limit, |row| *row).unwrap().is_empty());
    // It found nothing: a take past the other's batch follows. Rows 3 and
    // 4 are not committed yet.
    let (lower, through, limit) = take(&mut b);
    assert!(matches!((lower, through), (Lower::After(2), None)));
    b.taken(vec![5, 6], limit, |row| *row).unwrap();
    a.processed(2);
    let (lower, through, limit) = take(&mut a);
    assert!(matches!((lower, through), (Lower::After(6), None)));
    a.taken(vec![7], limit, |row| *row).unwrap();
    a.processed(1);
    // Past the loops the queue ran dry: a last look ahead of the other's
    // batch finds rows 3 and 4, committed late, and looks on after them
    // until a take comes back short.
    let (lower, through, limit) = take(&mut a);
    assert!(matches!((lower, through), (Lower::Unbounded, Some(5))));
    a.taken(vec![3, 4], limit, |row| *row).unwrap();
    a.processed(2);
    let (lower, through, limit) = take(&mut a);
    assert!(matches!((lower, through), (Lower::After(4), Some(5))));
    assert!(a.taken(Vec::new(), limit, |row| *row).unwrap().is_empty());
    assert!(matches!(a.next(), Step::Done));
    // The round's look ahead, which the other loop holds nothing for now,
    // goes through the last row taken past the loops, from where the look
    // before the last one ended (the loops' low water: row 1, where a
    // catch-up from the head is not due yet). It comes back short, yet the
    // run goes on past them: more may lie there.
    b.processed(2);
    let (lower, through, limit) = take(&mut b);
    assert!(matches!((lower, through), (Lower::After(1), Some(7))));
    assert!(b.taken(Vec::new(), limit, |row| *row).unwrap().is_empty());
    let (lower, through, limit) = take(&mut b);
    assert!(matches!((lower, through), (Lower::After(7), None)));
    b.taken(vec![8], limit, |row| *row).unwrap();
    b.processed(1);
    // Short past the loops again: the last look ahead, from the low water
    // (row 5 now), finds nothing, and the run ends.
    let (lower, through, limit) = take(&mut b);
    assert!(matches!((lower, through), (Lower::After(5), Some(8))));
    assert!(b.taken(Vec::new(), limit, |row| *row).unwrap().is_empty());
    assert!(matches!(b.next(), Step::Done));
}

/// A claim that is not a worker's on a pool, or whose rows do not come back
/// in the key's order, takes from the head of the whole query.
#[test]
fn only_takes_in_the_key_order_with_row_locks_steer() {
    let siblings = crate::claim::siblings::Siblings::new(2);
    siblings.slot(0).holds(1, 2, false);
    let marking = Claim::new(Plan {
        taking: Taking::Mark,
        ..head_plan(false)
    });
    let mut waiting_plan = head_plan(false);
    waiting_plan.clause.skip_locked = false;
    let waiting = Claim::new(waiting_plan);
    for mut claim in [marking, waiting] {
        claim.beside(siblings.slot(1));
        let Step::Batch(range, _) = claim.next() else {
            panic!("expected a take");
        };
        assert!(matches!(
            (range.lower, range.through),
            (Lower::Unbounded, None)
        ));
    }
}
