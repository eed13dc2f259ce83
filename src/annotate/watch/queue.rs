//! The frames waiting to be processed: newest or oldest first, and bounded by `--max-backlog`
//! (the oldest beyond it are handed back to be recorded as skipped).
use std::collections::BTreeSet;

/// Which waiting frame goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The latest arrival (frames that arrived together: the latest mtime).
    Newest,
    /// The earliest arrival.
    Oldest,
}

impl Order {
    /// Parses `newest` or `oldest`.
    pub fn parse(s: &str) -> Option<Order> {
        match s {
            "newest" => Some(Order::Newest),
            "oldest" => Some(Order::Oldest),
            _ => None,
        }
    }
}

/// Waiting frames, ordered by (arrival round, mtime, item).
#[derive(Debug)]
pub(crate) struct FrameQueue {
    order: Order,
    waiting: BTreeSet<(u64, i64, usize)>,
}

impl FrameQueue {
    /// An empty queue.
    pub(crate) fn new(order: Order) -> Self {
        FrameQueue { order, waiting: BTreeSet::new() }
    }

    /// Adds a frame that arrived in round `round` with modification time `mtime_ns`.
    pub(crate) fn push(&mut self, round: u64, mtime_ns: i64, item: usize) {
        self.waiting.insert((round, mtime_ns, item));
    }

    /// Frames waiting.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Removes and returns the oldest frames beyond `max` (none when `max` is 0: no bound).
    pub(crate) fn over(&mut self, max: usize) -> Vec<usize> {
        let mut out = Vec::new();
        while max > 0 && self.waiting.len() > max {
            if let Some(k) = self.waiting.pop_first() {
                out.push(k.2);
            }
        }
        out
    }

    /// Takes up to `n` frames in processing order.
    pub(crate) fn take(&mut self, n: usize) -> Vec<usize> {
        let mut out = Vec::new();
        while out.len() < n {
            let next = match self.order {
                Order::Newest => self.waiting.pop_last(),
                Order::Oldest => self.waiting.pop_first(),
            };
            match next {
                Some(k) => out.push(k.2),
                None => break,
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_first_and_the_oldest_beyond_the_backlog_go() {
        let mut q = FrameQueue::new(Order::Newest);
        for (round, mtime, item) in [(0, 5, 0), (0, 9, 1), (1, 1, 2), (2, 3, 3), (2, 2, 4)] {
            q.push(round, mtime, item);
        }
        assert_eq!(q.over(3), vec![0, 1]);
        assert_eq!(q.take(2), vec![3, 4]);
        assert_eq!(q.take(5), vec![2]);
        assert!(q.is_empty());
        let mut q = FrameQueue::new(Order::Oldest);
        for i in 0..4 {
            q.push(i, 0, i as usize);
        }
        assert_eq!(q.over(0), Vec::<usize>::new());
        assert_eq!(q.take(3), vec![0, 1, 2]);
        assert_eq!(q.len(), 1);
    }
}
