//! Independent compile work spread over the compile threads
//! (`LAZULI_COMPILE_THREADS`): pipeline creation ([`crate::pipeline`]) and
//! the lowering of a size variant's generic kernels ([`crate::compile`]).
//! Scoped threads take items in turn from a shared counter, so a slow
//! item does not hold up a fixed share of the rest; the results come back
//! in the items' order, whatever order they finished in. With one thread
//! (or one item, or where there are no threads: the browser) the items
//! run on the caller's thread, in order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `f` applied to each of `items` on up to `threads` threads, the results
/// in the items' order.
pub(crate) fn map<T: Sync, R: Send>(threads: usize, items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let j = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(j) else { break };
                let made = f(item);
                *slots[j].lock().unwrap_or_else(|e| e.into_inner()) = Some(made);
            });
        }
    });
    // A panic in `f` propagates out of the scope above, so every slot is
    // filled here.
    slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every item ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_the_items_order_on_any_number_of_threads() {
        let items: Vec<u64> = (0..100).collect();
        for threads in [0, 1, 2, 7, 200] {
            let got = map(threads, &items, |&x| {
                // Uneven work, so items finish out of order.
                std::thread::sleep(std::time::Duration::from_micros((x * 37) % 200));
                x * x
            });
            assert_eq!(got, items.iter().map(|x| x * x).collect::<Vec<_>>(), "{threads} threads");
        }
        assert!(map(4, &[] as &[u8], |_| 0).is_empty());
    }
}
