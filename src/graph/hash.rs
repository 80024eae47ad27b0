//! The hasher of the graph's maps, which are keyed by names the input chooses: foldhash
//! (several times faster than SipHash on short names) with seeds drawn from the operating
//! system's randomness once per process, so names crafted to collide cannot be prepared.

use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use foldhash::fast::SeedableRandomState;
use foldhash::SharedSeed;

pub type HashMap<K, V> = std::collections::HashMap<K, V, Seeded>;
pub type HashSet<T> = std::collections::HashSet<T, Seeded>;

/// foldhash seeded from std's `RandomState` (whose keys come from the OS).
#[derive(Clone)]
pub struct Seeded(SeedableRandomState);

impl Default for Seeded {
    fn default() -> Self {
        static SHARED: OnceLock<SharedSeed> = OnceLock::new();
        let os = RandomState::new();
        let shared = SHARED.get_or_init(|| SharedSeed::from_u64(os.hash_one(0u64)));
        Seeded(SeedableRandomState::with_seed(os.hash_one(1u64), shared))
    }
}

impl BuildHasher for Seeded {
    type Hasher = <SeedableRandomState as BuildHasher>::Hasher;
    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// An empty map with room for `n` entries.
pub fn map_with_capacity<K, V>(n: usize) -> HashMap<K, V> {
    HashMap::with_capacity_and_hasher(n, Seeded::default())
}

/// An empty set with room for `n` entries.
pub fn set_with_capacity<T>(n: usize) -> HashSet<T> {
    HashSet::with_capacity_and_hasher(n, Seeded::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two maps hash the same name differently: the seed is not a constant.
    #[test]
    fn seeds_differ() {
        let (a, b) = (Seeded::default(), Seeded::default());
        assert_ne!(a.hash_one("name"), b.hash_one("name"));
    }
}
