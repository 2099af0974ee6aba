//! `DistributedSampler`: each rank's shard of each epoch's permutation, as
//! PyTorch's `torch.utils.data.DistributedSampler`.
//!
//! The permutation of epoch `e` is a seeded shuffle of `0..len` (the seed
//! is `seed + e`, the same on every rank; `HostRng`: SplitMix64 and Fisher-Yates, not
//! PyTorch's generator, so the orders differ from PyTorch's). Without
//! `drop_last` the permutation is padded with its own first indices to a
//! multiple of the world size; with it, the tail that does not divide is
//! dropped. Rank `r` takes every `world`-th index from `r`, so with a
//! per-rank batch of `b` the ranks' `s`-th batches together are the
//! permutation's `s`-th global batch of `b * world` rows: training on `N`
//! ranks sees the same global batches as one process with the same
//! permutation.

use crate::DistError;
use lazuli_executor::HostRng;

/// Which indices of a dataset this rank visits each epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` rows for `rank` of `world` (shuffling, seed 0,
    /// padding: PyTorch's defaults). A rank outside the world is an error.
    pub fn new(len: usize, world: usize, rank: usize) -> Result<DistributedSampler, DistError> {
        if world == 0 || rank >= world {
            return Err(DistError::Invalid {
                op: "DistributedSampler::new",
                detail: format!("rank {rank} is not within a world of {world}"),
            });
        }
        Ok(DistributedSampler { len, world, rank, shuffle: true, seed: 0, drop_last: false, epoch: 0 })
    }

    /// Shuffles each epoch (default) or keeps the dataset's order.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed shared by every rank.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drops the tail that does not divide by the world size instead of
    /// padding.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which picks the permutation.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// Rows per rank per epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// The whole permutation of the current epoch (before sharding).
    pub fn permutation(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            HostRng::new(self.seed.wrapping_add(self.epoch)).shuffle(&mut order);
        }
        order
    }

    /// This rank's indices for the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        let mut order = self.permutation();
        let total = self.num_samples() * self.world;
        if total > order.len() && !order.is_empty() {
            let mut i = 0;
            while order.len() < total {
                order.push(order[i]);
                i += 1;
            }
        }
        order.truncate(total);
        order.into_iter().skip(self.rank).step_by(self.world).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(len: usize, world: usize, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
        (0..world)
            .map(|r| {
                let mut s = DistributedSampler::new(len, world, r).unwrap().seed(7).drop_last(drop_last);
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn padding_covers_every_row_and_gives_equal_shards() {
        let s = shards(10, 3, false, 0);
        assert!(s.iter().all(|r| r.len() == 4));
        let mut all: Vec<usize> = s.concat();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn drop_last_gives_disjoint_equal_shards() {
        let s = shards(10, 3, true, 0);
        assert!(s.iter().all(|r| r.len() == 3));
        let mut all: Vec<usize> = s.concat();
        all.sort_unstable();
        let n = all.len();
        all.dedup();
        assert_eq!(all.len(), n, "no row twice");
    }

    #[test]
    fn ranks_batches_together_are_the_global_batches() {
        let (len, world, b) = (24, 3, 2);
        let perm = DistributedSampler::new(len, 1, 0).unwrap().seed(7).permutation();
        let s = shards(len, world, true, 0);
        for step in 0..len / (b * world) {
            let mut mine: Vec<usize> = s.iter().flat_map(|r| r[step * b..(step + 1) * b].to_vec()).collect();
            let mut global = perm[step * b * world..(step + 1) * b * world].to_vec();
            mine.sort_unstable();
            global.sort_unstable();
            assert_eq!(mine, global, "step {step}");
        }
    }

    #[test]
    fn epochs_change_the_permutation_and_no_shuffle_keeps_the_order() {
        assert_ne!(shards(50, 2, false, 0), shards(50, 2, false, 1));
        let s = DistributedSampler::new(5, 2, 1).unwrap().shuffle(false);
        assert_eq!(s.indices(), vec![1, 3, 0]);
        assert!(DistributedSampler::new(5, 2, 2).is_err());
    }
}
