//! A byte-bounded cache of frozen-backbone features: with only the head training and no
//! augmentation in front of the backbone, its output for an image never changes.
use std::collections::HashMap;

use crate::models::training::Features;

/// Features by (validation?, index), up to a byte budget; beyond it features are recomputed.
pub(crate) struct FeatureCache {
    budget: usize,
    used: usize,
    items: HashMap<(bool, usize), Features>,
}

impl FeatureCache {
    /// A cache holding at most `budget` bytes (0: none).
    pub(crate) fn new(budget: usize) -> Self {
        FeatureCache { budget, used: 0, items: HashMap::new() }
    }

    /// The cached features of `key`.
    pub(crate) fn get(&self, key: (bool, usize)) -> Option<Features> {
        self.items.get(&key).cloned()
    }

    /// Keeps `f` if it fits in what is left of the budget.
    pub(crate) fn insert(&mut self, key: (bool, usize), f: &Features) {
        let b = f.bytes();
        if self.used + b <= self.budget && !self.items.contains_key(&key) {
            self.used += b;
            self.items.insert(key, f.clone());
        }
    }
}
