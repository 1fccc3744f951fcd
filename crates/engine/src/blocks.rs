//! The paged KV cache's blocks as the batching scheduler hands them out: each held by the
//! tables that name it (a count per block), and found again by its contents. A block whose
//! positions a sequence has computed, whole, is known by a hash of every token up to its
//! end; a later sequence whose tokens begin alike takes those blocks instead of computing
//! them again (prefix caching: a shared system prompt, or a conversation's earlier turns).
//! Nothing writes into a shared block: a sequence shares only whole blocks before its first
//! uncomputed position, and writes from there on into blocks of its own. Blocks no table
//! holds are reused least recently released first (a table's last blocks before its first),
//! and keep their contents until then.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use tpinfer_layers::BlockTable;

/// A computed block's identity: its tokens, and (through `prefix`) every token before them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Contents {
    /// The hash of every token up to the block's end.
    prefix: u64,
    tokens: Vec<u32>,
}

pub(crate) struct BlockPool {
    size: usize,
    /// How many tables hold each block.
    holders: Vec<u32>,
    /// What each computed block holds, while it holds it.
    contents: Vec<Option<Contents>>,
    /// Blocks no table holds, least recently released first. A block taken back by a prefix
    /// match stays listed (at its place, if released again) until it comes up, and is
    /// skipped then if held.
    free: VecDeque<u32>,
    /// Whether each block is in `free`.
    listed: Vec<bool>,
    /// Blocks no table holds.
    free_count: usize,
    /// Computed blocks by their prefix hash.
    by_prefix: HashMap<u64, u32>,
}

/// The hash of the tokens up to a block's end, from the hash up to its start.
fn chain(prefix: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prefix.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl BlockPool {
    pub(crate) fn new(count: usize, size: usize) -> Self {
        Self {
            size,
            holders: vec![0; count],
            contents: vec![None; count],
            free: (0..count as u32).collect(),
            listed: vec![true; count],
            free_count: count,
            by_prefix: HashMap::new(),
        }
    }

    /// Blocks held by some table.
    pub(crate) fn used(&self) -> usize {
        self.holders.len() - self.free_count
    }

    /// Grows `table` to cover `positions`; false, and nothing taken, if too few are free.
    pub(crate) fn cover(&mut self, table: &mut BlockTable, positions: usize) -> bool {
        let needed = positions.div_ceil(self.size).saturating_sub(table.blocks.len());
        if needed > self.free_count {
            return false;
        }
        for _ in 0..needed {
            let Some(block) = self.take_free() else {
                return false;
            };
            table.blocks.push(block);
        }
        true
    }

    /// The least recently released free block, forgotten as a computed one.
    fn take_free(&mut self) -> Option<u32> {
        while let Some(block) = self.free.pop_front() {
            let b = block as usize;
            self.listed[b] = false;
            if self.holders[b] != 0 {
                continue; // taken back by a prefix match since it was listed
            }
            if let Some(c) = self.contents[b].take() {
                if self.by_prefix.get(&c.prefix) == Some(&block) {
                    self.by_prefix.remove(&c.prefix);
                }
            }
            self.holders[b] = 1;
            self.free_count -= 1;
            return Some(block);
        }
        None
    }

    /// Gives back `table`'s blocks; those no other table holds become free, its last blocks
    /// first: a prefix's first blocks, which more sequences can share, are reused last.
    pub(crate) fn release(&mut self, table: &mut BlockTable) {
        for block in table.blocks.drain(..).rev() {
            let b = block as usize;
            self.holders[b] -= 1;
            if self.holders[b] == 0 {
                self.free_count += 1;
                if !self.listed[b] {
                    self.listed[b] = true;
                    self.free.push_back(block);
                }
            }
        }
    }

    /// Starts an empty `table` with the computed blocks that hold the first positions of
    /// `tokens`, whole blocks only and never the last token (whose logits the sequence needs
    /// from its own forward). Returns the positions they cover.
    pub(crate) fn share_prefix(&mut self, table: &mut BlockTable, tokens: &[u32]) -> usize {
        debug_assert!(table.blocks.is_empty());
        let mut prefix = 0;
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(self.size) {
            prefix = chain(prefix, chunk);
            let Some(&block) = self.by_prefix.get(&prefix) else {
                break;
            };
            let b = block as usize;
            if self.contents[b].as_ref().is_none_or(|c| c.tokens != chunk) {
                break; // a hash collision: not the same tokens
            }
            if self.holders[b] == 0 {
                self.free_count -= 1;
            }
            self.holders[b] += 1;
            table.blocks.push(block);
        }
        table.blocks.len() * self.size
    }

    /// Records the blocks of `table` that positions `from..to` of `tokens` completed, so that
    /// later sequences can share them.
    pub(crate) fn computed(&mut self, table: &BlockTable, tokens: &[u32], from: usize, to: usize) {
        let first = from / self.size;
        let last = to / self.size; // blocks before this one are whole
        if first >= last {
            return;
        }
        let mut prefix = match first {
            0 => 0,
            _ => match table
                .blocks
                .get(first - 1)
                .and_then(|&b| self.contents[b as usize].as_ref())
            {
                Some(c) => c.prefix,
                // The block before was never recorded (its sequence began before recording
                // could reach it): hash from the start.
                None => tokens[..first * self.size].chunks_exact(self.size).fold(0, chain),
            },
        };
        for i in first..last {
            let chunk = &tokens[i * self.size..(i + 1) * self.size];
            prefix = chain(prefix, chunk);
            let Some(&block) = table.blocks.get(i) else {
                return;
            };
            let b = block as usize;
            if self.contents[b].is_some() {
                continue; // shared, or recorded already
            }
            self.contents[b] = Some(Contents {
                prefix,
                tokens: chunk.to_vec(),
            });
            self.by_prefix.entry(prefix).or_insert(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> BlockTable {
        BlockTable::default()
    }

    #[test]
    fn a_computed_prefix_is_shared_whole_blocks_only_and_never_the_last_token() {
        let mut pool = BlockPool::new(8, 4);
        let prompt: Vec<u32> = (0..10).collect();
        let mut first = table();
        assert!(pool.cover(&mut first, prompt.len()));
        pool.computed(&first, &prompt, 0, prompt.len());
        // Positions 0..8 are two whole blocks; 8..10 a partial third, never shared.
        let mut second = table();
        assert_eq!(pool.share_prefix(&mut second, &prompt), 8);
        assert_eq!(second.blocks, first.blocks[..2]);
        // A prompt of exactly two blocks shares one: its last token is computed again.
        let mut third = table();
        assert_eq!(pool.share_prefix(&mut third, &prompt[..8]), 4);
        // Another first block shares nothing, even with the same later tokens.
        let mut other = table();
        let mut changed = prompt.clone();
        changed[0] = 99;
        assert_eq!(pool.share_prefix(&mut other, &changed), 0);
    }

    #[test]
    fn shared_blocks_stay_until_their_last_holder_releases_them() {
        let mut pool = BlockPool::new(4, 2);
        let tokens: Vec<u32> = (0..5).collect();
        let mut a = table();
        assert!(pool.cover(&mut a, 5));
        pool.computed(&a, &tokens, 0, 5);
        let mut b = table();
        assert_eq!(pool.share_prefix(&mut b, &tokens), 4);
        assert_eq!(pool.used(), 3, "two shared blocks and a's own third");
        pool.release(&mut a);
        assert_eq!(pool.used(), 2, "b still holds the shared two");
        // Two blocks are free: a request for three fails and takes nothing.
        let mut c = table();
        assert!(!pool.cover(&mut c, 6));
        assert!(c.blocks.is_empty());
        pool.release(&mut b);
        assert_eq!(pool.used(), 0);
        // Freed blocks keep their contents until reused: the prefix is found again.
        let mut d = table();
        assert_eq!(pool.share_prefix(&mut d, &tokens), 4);
        pool.release(&mut d);
        // Taking every block reuses them, and forgets what they held.
        let mut e = table();
        assert!(pool.cover(&mut e, 8));
        assert_eq!(pool.used(), 4);
        let mut f = table();
        assert_eq!(pool.share_prefix(&mut f, &tokens), 0);
    }

    #[test]
    fn free_blocks_are_reused_least_recently_released_first() {
        let mut pool = BlockPool::new(3, 1);
        let (mut a, mut b, mut c) = (table(), table(), table());
        assert!(pool.cover(&mut a, 1) && pool.cover(&mut b, 1) && pool.cover(&mut c, 1));
        let (ia, ib) = (a.blocks[0], b.blocks[0]);
        pool.release(&mut b);
        pool.release(&mut a);
        let mut d = table();
        assert!(pool.cover(&mut d, 1));
        assert_eq!(d.blocks, vec![ib], "b was released first");
        let mut e = table();
        assert!(pool.cover(&mut e, 1));
        assert_eq!(e.blocks, vec![ia]);
    }

    #[test]
    fn a_prefix_taken_and_given_back_again_and_again_is_listed_once() {
        let mut pool = BlockPool::new(2, 2);
        let tokens = [1, 2, 3];
        let mut a = table();
        assert!(pool.cover(&mut a, 3));
        pool.computed(&a, &tokens, 0, 3);
        pool.release(&mut a);
        for _ in 0..100 {
            let mut b = table();
            assert_eq!(pool.share_prefix(&mut b, &tokens), 2);
            pool.release(&mut b);
        }
        assert_eq!(pool.free.len(), 2);
        assert_eq!(pool.used(), 0);
    }
}
