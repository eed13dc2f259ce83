//! Grouping work items into batches of equal tensor size.

/// Splits item indices into runs of at most `max_batch` consecutive items whose `key` is equal.
pub(crate) fn group_by_key<K: PartialEq>(keys: &[K], max_batch: usize) -> Vec<std::ops::Range<usize>> {
    let max_batch = max_batch.max(1);
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=keys.len() {
        if i == keys.len() || keys[i] != keys[start] || i - start == max_batch {
            if i > start {
                out.push(start..i);
            }
            start = i;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::group_by_key;

    #[test]
    fn groups_equal_runs_up_to_the_batch_size() {
        let keys = [1, 1, 1, 2, 2, 1];
        assert_eq!(group_by_key(&keys, 2), vec![0..2, 2..3, 3..5, 5..6]);
        assert_eq!(group_by_key::<u8>(&[], 4), Vec::<std::ops::Range<usize>>::new());
    }
}
