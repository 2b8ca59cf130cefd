//! Picking a node: a pure function of what the nodes reported.
//!
//! The control plane never reads spec bodies, so it never knows what a jail
//! will ask for: it ranks nodes by their own reports of capacity and committed
//! resources. That makes [`pick_node`] a ranking heuristic, not an admission
//! guarantee: a node with no headroom left is still picked when every node is
//! full, and the node's agent then refuses or fails the jail as it would on a
//! single host.

use std::collections::BTreeSet;

use crate::common::wire::Resources;

/// One Alive node the scheduler may pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    /// Node id.
    pub node_id: &'a str,
    /// Host size.
    pub capacity: Resources,
    /// What its jails have committed.
    pub committed: Resources,
    /// How many jails it holds, as far as the control plane knows (its last
    /// report plus what was placed since): the tie-break between nodes of
    /// equal headroom, so jails that request nothing spread too.
    pub jails: u32,
}

impl Candidate<'_> {
    /// Headroom in the most constrained dimension, in 0.0..=1.0:
    /// `min(free_cpu / cap_cpu, free_mem / cap_mem)`.
    pub fn headroom(&self) -> f64 {
        let cpu = fraction_free(self.capacity.cpu, self.committed.cpu);
        let mem = fraction_free(self.capacity.memory as f64, self.committed.memory as f64);
        cpu.min(mem)
    }
}

fn fraction_free(capacity: f64, committed: f64) -> f64 {
    if capacity.is_nan() || capacity <= 0.0 {
        return 0.0;
    }
    ((capacity - committed) / capacity).clamp(0.0, 1.0)
}

/// The candidate with the most headroom; a tie goes to the one holding
/// fewer jails, then to the smallest node id. `None` only when there is no
/// candidate at all.
pub fn pick_node<'a>(candidates: &[Candidate<'a>]) -> Option<&'a str> {
    candidates
        .iter()
        .max_by(|a, b| {
            a.headroom()
                .total_cmp(&b.headroom())
                // max_by keeps the last of equals: reverse the order of the
                // tie-breaks so the fewest jails, then the smallest id, win.
                .then_with(|| b.jails.cmp(&a.jails))
                .then_with(|| b.node_id.cmp(a.node_id))
        })
        .map(|c| c.node_id)
}

/// [`pick_node`] preferring nodes not in `avoid` (nodes already running a
/// replica of the same service); falls back to every candidate when all are
/// to be avoided, since a second replica on a node beats none.
pub fn pick_node_spread<'a>(
    candidates: &[Candidate<'a>],
    avoid: &BTreeSet<&str>,
) -> Option<&'a str> {
    let preferred: Vec<Candidate<'a>> = candidates
        .iter()
        .filter(|c| !avoid.contains(c.node_id))
        .cloned()
        .collect();
    pick_node(&preferred).or_else(|| pick_node(candidates))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, cap: (f64, u64), used: (f64, u64)) -> Candidate<'_> {
        Candidate {
            node_id: id,
            capacity: Resources {
                cpu: cap.0,
                memory: cap.1,
            },
            committed: Resources {
                cpu: used.0,
                memory: used.1,
            },
            jails: 0,
        }
    }

    #[test]
    fn the_most_constrained_dimension_decides() {
        // a: 50 % cpu free, 10 % memory free -> 0.1; b: 30 % / 30 % -> 0.3.
        let nodes = [
            node("a", (4.0, 100), (2.0, 90)),
            node("b", (4.0, 100), (2.8, 70)),
        ];
        assert_eq!(pick_node(&nodes), Some("b"));
    }

    #[test]
    fn ties_go_to_the_smallest_id() {
        let nodes = [
            node("c", (4.0, 100), (0.0, 0)),
            node("a", (8.0, 200), (0.0, 0)),
            node("b", (4.0, 100), (0.0, 0)),
        ];
        assert_eq!(pick_node(&nodes), Some("a"));
    }

    #[test]
    fn equal_headroom_goes_to_the_node_holding_fewer_jails() {
        let mut nodes = [
            node("a", (4.0, 100), (0.0, 0)),
            node("b", (4.0, 100), (0.0, 0)),
        ];
        nodes[0].jails = 3;
        nodes[1].jails = 2;
        assert_eq!(pick_node(&nodes), Some("b"));
        nodes[1].jails = 3;
        assert_eq!(pick_node(&nodes), Some("a"), "then by id");
        // Headroom still comes first.
        nodes[0].committed.cpu = 1.0;
        nodes[1].jails = 9;
        assert_eq!(pick_node(&nodes), Some("b"));
    }

    #[test]
    fn when_all_are_full_the_smallest_id_is_still_picked() {
        let nodes = [
            node("b", (4.0, 100), (6.0, 100)),
            node("a", (4.0, 100), (4.0, 200)),
        ];
        assert_eq!(pick_node(&nodes), Some("a"));
    }

    #[test]
    fn no_candidates_no_node() {
        assert_eq!(pick_node(&[]), None);
    }

    #[test]
    fn a_node_reporting_no_capacity_has_no_headroom() {
        let nodes = [
            node("a", (0.0, 0), (0.0, 0)),
            node("b", (4.0, 100), (3.9, 99)),
        ];
        assert_eq!(pick_node(&nodes), Some("b"));
    }

    #[test]
    fn spreading_avoids_nodes_with_a_replica_unless_all_have_one() {
        let nodes = [
            node("a", (4.0, 100), (0.0, 0)),
            node("b", (4.0, 100), (3.0, 80)),
        ];
        let avoid: BTreeSet<&str> = ["a"].into();
        assert_eq!(pick_node_spread(&nodes, &avoid), Some("b"));
        let all: BTreeSet<&str> = ["a", "b"].into();
        assert_eq!(pick_node_spread(&nodes, &all), Some("a"));
    }
}
