//! Names numbered densely in the order first seen, for the per-tensor tables of a whole graph
//! (`GraphIndex`'s producers and readers, the consistency check's defined tensors).
//!
//! A `HashMap<&str, V>` over a million tensors holds 24–48 bytes a slot (a name's pointer and
//! length beside the value) in twice as many slots, 48–96 MiB per map, far past the processor's
//! cache, and each walk along the graph missed it at every step. Here a slot is 8 bytes (the
//! name's number and half its hash, so a probe compares names only where the hashes agree);
//! what a name maps to lives in plain vectors indexed by its number, in graph order, so walks
//! along the graph read them nearly in sequence. Measured (bench/README.md, "Growth"): the
//! 1 M-node chain's peak RSS 12 % lower, its time per node now the 500 k chain's.

use std::hash::BuildHasher;

use super::hash::Seeded;

/// No name in this slot.
const EMPTY: u64 = u64::MAX;

pub struct NameIds<'g> {
    /// Open addressing with linear probing: each slot a name's number in the low half and
    /// the high half of its hash in the high half (a probe compares names only where the
    /// hashes agree), or `EMPTY`.
    slots: Vec<u64>,
    names: Vec<&'g str>,
    hasher: Seeded,
}

impl<'g> NameIds<'g> {
    /// Room for `n` names without growing.
    pub fn with_capacity(n: usize) -> Self {
        NameIds {
            slots: vec![EMPTY; slot_count(n)],
            names: Vec::with_capacity(n),
            hasher: Seeded::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// `name`'s number, where it has one.
    pub fn get(&self, name: &str) -> Option<usize> {
        match self.slots[self.find(name, self.hash(name))] {
            EMPTY => None,
            slot => Some(slot as u32 as usize),
        }
    }

    /// `name`'s number, given the next one where it had none.
    pub fn intern(&mut self, name: &'g str) -> usize {
        let hash = self.hash(name);
        let slot = self.find(name, hash);
        if self.slots[slot] != EMPTY {
            return self.slots[slot] as u32 as usize;
        }
        let id = self.names.len();
        assert!(id < u32::MAX as usize, "more than 4 billion names");
        self.names.push(name);
        self.slots[slot] = tagged(hash, id);
        if self.names.len() * 2 > self.slots.len() {
            self.grow();
        }
        id
    }

    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The slot holding `name` (of hash `hash`), or the empty slot where it belongs.
    fn find(&self, name: &str, hash: u64) -> usize {
        let mask = self.slots.len() - 1;
        let tag = hash >> 32;
        let mut slot = hash as usize & mask;
        loop {
            match self.slots[slot] {
                EMPTY => return slot,
                s if s >> 32 == tag && self.names[s as u32 as usize] == name => return slot,
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    fn grow(&mut self) {
        self.slots = vec![EMPTY; self.slots.len() * 2];
        for id in 0..self.names.len() {
            let hash = self.hash(self.names[id]);
            let slot = self.find(self.names[id], hash);
            self.slots[slot] = tagged(hash, id);
        }
    }
}

fn tagged(hash: u64, id: usize) -> u64 {
    (hash >> 32) << 32 | id as u64
}

/// A power of two at least twice `n`: probes stay short at half load.
fn slot_count(n: usize) -> usize {
    (2 * n.max(4)).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::NameIds;

    #[test]
    fn names_get_dense_numbers_in_first_seen_order() {
        let names: Vec<String> = (0..1000).map(|i| format!("t{i}")).collect();
        // too small on purpose: it grows
        let mut ids = NameIds::with_capacity(3);
        for (i, n) in names.iter().enumerate() {
            assert_eq!(ids.intern(n), i);
        }
        for (i, n) in names.iter().enumerate() {
            assert_eq!(ids.intern(n), i);
            assert_eq!(ids.get(n), Some(i));
        }
        assert_eq!(ids.get("t1000"), None);
        assert_eq!(ids.get(""), None);
        assert_eq!(ids.len(), 1000);
    }
}
