//! Independent compile work spread over the compile threads
//! (`LAZULI_COMPILE_THREADS`): pipeline creation ([`crate::compile::pipeline`]) and
//! the lowering of a size variant's generic kernels ([`crate::compile`]).
//! The threads are a pool made once per backend ([`Workers`], rayon's):
//! a size variant lowers its kernels on them every step of a growing
//! loop, where starting threads each time would cost a good part of what
//! they save. The results come back in the items' order, whatever order
//! they finished in. With one thread (or one item, or where there are no
//! threads: the browser) the items run on the caller's thread, in order.

use rayon::prelude::*;

/// The compile threads of one backend.
pub(crate) struct Workers {
    threads: usize,
    /// `None` with one thread, or where the pool could not be made (the
    /// work then runs on the caller's thread).
    pool: Option<rayon::ThreadPool>,
}

impl Workers {
    /// A backend's compile threads: `threads` of them (`None`: the
    /// machine's cores, at most 8; one where there are no threads, see
    /// `platform`).
    pub fn for_compiles(threads: Option<usize>) -> Workers {
        let threads = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(8));
        Workers::new(if crate::device::platform::THREADS { threads.max(1) } else { 1 })
    }

    /// `threads` compile threads (at least one).
    pub fn new(threads: usize) -> Workers {
        let threads = threads.max(1);
        let pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("lazuli-compile-{i}"))
                    .build()
            })
            .and_then(|made| made.map_err(|e| tracing::warn!("compiling on one thread: {e}")).ok());
        Workers { threads, pool }
    }

    /// How many there are.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// `f` applied to each of `items`, on the threads where there are
    /// several items, the results in the items' order.
    pub fn map<T: Sync, R: Send>(&self, items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
        match &self.pool {
            Some(pool) if items.len() > 1 => pool.install(|| items.par_iter().with_max_len(1).map(f).collect()),
            _ => items.iter().map(f).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_the_items_order_on_any_number_of_threads() {
        let items: Vec<u64> = (0..100).collect();
        for threads in [0, 1, 2, 7] {
            let workers = Workers::new(threads);
            let got = workers.map(&items, |&x| {
                // Uneven work, so items finish out of order.
                std::thread::sleep(std::time::Duration::from_micros((x * 37) % 200));
                x * x
            });
            assert_eq!(got, items.iter().map(|x| x * x).collect::<Vec<_>>(), "{threads} threads");
            assert_eq!(workers.threads(), threads.max(1));
        }
        assert!(Workers::new(4).map(&[] as &[u8], |_| 0).is_empty());
    }

    #[test]
    fn the_work_runs_on_several_threads() {
        let workers = Workers::new(2);
        let names = workers.map(&[0u8; 64], |_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            std::thread::current().name().unwrap_or("").to_string()
        });
        assert!(names.iter().all(|n| n.starts_with("lazuli-compile-")), "{names:?}");
        let distinct: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), 2, "{names:?}");
    }
}
