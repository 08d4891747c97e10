//! Which rank to blame for a failed group. The rank whose exit the launcher saw first is not
//! always the one with the real error: a rank that hits an error and lingers (cleaning up,
//! flushing) closes its sockets first, and its peers' collectives fail and exit before it does.
//! Their output says so ("failed talking to rank 1", "timed out ... waiting for rank 1"), which
//! is what this module reads.

use std::collections::{HashMap, VecDeque};

/// Phrases of a failure caused by another rank (the collective errors of accelerate-rs and the
/// OS errors behind them).
const SECONDARY: [&str; 8] = [
    "failed talking to rank",
    "waiting for rank",
    "the communicator is unusable",
    "left the group",
    "closed the connection",
    "connection reset",
    "broken pipe",
    "peer went away",
];

/// Whether a rank's last lines describe a failure caused by another rank.
pub(crate) fn is_secondary(tail: &VecDeque<String>) -> bool {
    tail.iter().any(|l| {
        let l = l.to_ascii_lowercase();
        SECONDARY.iter().any(|p| l.contains(p))
    })
}

/// Whether a rank's last lines report an error of its own.
fn reports_error(tail: &VecDeque<String>) -> bool {
    !is_secondary(tail)
        && tail.iter().any(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("error") || l.contains("failed") || l.contains("panicked")
        })
}

/// The rank a secondary failure points at ("... rank 3 ..." after one of the phrases).
fn peer_named(tail: &VecDeque<String>) -> Option<usize> {
    tail.iter().rev().find_map(|l| {
        let low = l.to_ascii_lowercase();
        SECONDARY.iter().find_map(|p| {
            let at = low.find(p)? + p.len();
            let rest = low[at..].trim_start();
            let rest = rest.strip_prefix("rank").unwrap_or(rest).trim_start();
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    })
}

/// The rank to blame: `first` (whose failure was seen first) unless its output shows it failed
/// because of another rank that reported an error of its own; then that rank (the one it names
/// when it names one). `failed` lists the ranks that exited unsuccessfully on their own (not
/// stopped by the launcher); `tails` holds each rank's last lines.
pub(crate) fn blame(
    first: usize,
    failed: &[usize],
    tails: &HashMap<usize, VecDeque<String>>,
) -> usize {
    let empty = VecDeque::new();
    let tail = |r: usize| tails.get(&r).unwrap_or(&empty);
    if !is_secondary(tail(first)) {
        return first;
    }
    if let Some(peer) = peer_named(tail(first)) {
        if peer != first && failed.contains(&peer) && reports_error(tail(peer)) {
            return peer;
        }
    }
    failed
        .iter()
        .copied()
        .filter(|&r| r != first)
        .find(|&r| reports_error(tail(r)))
        .unwrap_or(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tails(entries: &[(usize, &[&str])]) -> HashMap<usize, VecDeque<String>> {
        entries
            .iter()
            .map(|(r, lines)| (*r, lines.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn a_peer_failure_points_at_the_rank_with_the_real_error() {
        let t = tails(&[
            (0, &["step 3", "worker failed: rank 0: all_reduce failed talking to rank 2: closed the connection"]),
            (1, &["step 3", "worker failed: rank 1: all_reduce timed out after 30s waiting for rank 2"]),
            (2, &["step 3", "Error: data: shard 7 is truncated"]),
        ]);
        assert_eq!(blame(0, &[0, 1, 2], &t), 2);
        assert_eq!(blame(1, &[0, 1, 2], &t), 2);
        // The real error is kept when seen first, and so is a first failure that is not a peer
        // failure.
        assert_eq!(blame(2, &[0, 1, 2], &t), 2);
        let t2 = tails(&[
            (0, &["Error: out of memory"]),
            (1, &["failed talking to rank 0"]),
        ]);
        assert_eq!(blame(0, &[0, 1], &t2), 0);
    }

    #[test]
    fn without_a_better_candidate_the_first_failure_stays() {
        // The named rank did not fail on its own (the launcher stopped it), or printed nothing.
        let t = tails(&[
            (0, &["failed talking to rank 1: broken pipe"]),
            (1, &["step 9"]),
        ]);
        assert_eq!(blame(0, &[0], &t), 0);
        assert_eq!(blame(0, &[0, 1], &t), 0);
        assert_eq!(blame(0, &[0, 1], &HashMap::new()), 0);
        // A peer failure naming nobody: the first rank that reported an error of its own.
        let t = tails(&[
            (0, &["Connection reset by peer"]),
            (3, &["thread 'main' panicked at x"]),
        ]);
        assert_eq!(blame(0, &[0, 3], &t), 3);
    }

    #[test]
    fn the_named_peer_is_parsed() {
        let t: VecDeque<String> =
            ["rank 0: broadcast failed talking to rank 12: eof".to_string()].into();
        assert_eq!(peer_named(&t), Some(12));
        let t: VecDeque<String> =
            ["rank 4: barrier timed out after 5s waiting for rank 3".to_string()].into();
        assert_eq!(peer_named(&t), Some(3));
    }
}
