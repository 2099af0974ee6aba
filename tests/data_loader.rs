//! The data loader: seeded per-epoch shuffles (reproducible, a
//! permutation, different across epochs), batching with and without
//! drop_last, fields stacked as PyTorch's default collate, background
//! prefetch (the same batches as preparing inline; early drops stop the
//! thread), a custom `Dataset`, and errors instead of panics for bad
//! configurations.

mod common;

use lazuli::data::{DataLoader, Dataset, HostArray, TensorDataset};
use lazuli::{DType, Device, DeviceExt, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 10 samples: x = [i, 10 i] (f32), y = i (i32).
fn dataset() -> TensorDataset {
    let xs: Vec<f32> = (0..10).flat_map(|i| [i as f32, 10.0 * i as f32]).collect();
    let ys: Vec<i32> = (0..10).collect();
    TensorDataset::new(vec![HostArray::from_slice(&xs, &[10, 2]).unwrap(), HostArray::from_slice(&ys, &[10]).unwrap()])
        .unwrap()
}

/// The labels of every batch of `epoch`.
fn labels(loader: &DataLoader<impl Dataset + 'static>, epoch: u64) -> Vec<Vec<i32>> {
    loader.epoch(epoch).unwrap().map(|b| b.unwrap()[1].to_vec::<i32>().unwrap()).collect()
}

#[test]
fn batches_in_order_with_and_without_drop_last() {
    let dev = Device::cpu();
    let loader = DataLoader::new(dataset(), 4, &dev).unwrap();
    assert_eq!(loader.len(), 3);
    assert_eq!(labels(&loader, 0), [vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
    let batch = loader.epoch(0).unwrap().next().unwrap().unwrap();
    assert_eq!(batch[0].dims(), [4, 2]);
    assert_eq!(batch[0].dtype(), DType::F32);
    assert_eq!(batch[0].to_vec::<f32>().unwrap(), [0.0, 0.0, 1.0, 10.0, 2.0, 20.0, 3.0, 30.0]);
    assert_eq!(batch[0].state(), lazuli::TensorState::HostData, "prepared on the host");
    let loader = DataLoader::new(dataset(), 4, &dev).unwrap().drop_last(true);
    assert_eq!(loader.len(), 2);
    assert_eq!(labels(&loader, 0), [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    // A batch larger than the dataset: one short batch, or none.
    assert_eq!(labels(&DataLoader::new(dataset(), 32, &dev).unwrap(), 0), [(0..10).collect::<Vec<_>>()]);
    let none = DataLoader::new(dataset(), 32, &dev).unwrap().drop_last(true);
    assert!(none.is_empty() && labels(&none, 0).is_empty());
}

#[test]
fn shuffles_are_seeded_per_epoch() {
    let dev = Device::cpu();
    let loader = DataLoader::new(dataset(), 3, &dev).unwrap().shuffle(7);
    let e0 = labels(&loader, 0);
    // Reproducible: the same seed and epoch give the same batches, also
    // from a new loader (a resumed run).
    assert_eq!(labels(&DataLoader::new(dataset(), 3, &dev).unwrap().shuffle(7), 0), e0);
    assert_eq!(labels(&loader, 0), e0);
    // A permutation of every sample.
    let mut all: Vec<i32> = e0.concat();
    assert_ne!(all, (0..10).collect::<Vec<_>>(), "shuffled");
    all.sort();
    assert_eq!(all, (0..10).collect::<Vec<_>>());
    // Another epoch or seed gives another order.
    assert_ne!(labels(&loader, 1), e0);
    assert_ne!(labels(&DataLoader::new(dataset(), 3, &dev).unwrap().shuffle(8), 0), e0);
    // Rows stay together: x = [y, 10 y].
    for b in loader.epoch(3).unwrap() {
        let b = b.unwrap();
        let (x, y) = (b[0].to_vec::<f32>().unwrap(), b[1].to_vec::<i32>().unwrap());
        for (i, &label) in y.iter().enumerate() {
            assert_eq!((x[2 * i], x[2 * i + 1]), (label as f32, 10.0 * label as f32));
        }
    }
    // Every position is reachable: over many epochs each sample leads a batch.
    let mut firsts = std::collections::BTreeSet::new();
    for epoch in 0..200 {
        firsts.insert(loader.order(epoch)[0]);
    }
    assert_eq!(firsts.len(), 10);
}

#[test]
fn prefetching_gives_the_inline_batches_and_stops_when_dropped() {
    let dev = Device::cpu();
    let base = || DataLoader::new(dataset(), 3, &dev).unwrap().shuffle(1);
    let inline = labels(&base().prefetch(0), 2);
    for prefetch in [1, 2, 8] {
        assert_eq!(labels(&base().prefetch(prefetch), 2), inline, "prefetch {prefetch}");
    }
    // Taking one batch and dropping the rest joins the thread.
    let mut it = base().prefetch(1).epoch(0).unwrap();
    assert!(it.next().unwrap().is_ok());
    drop(it);
    // Batches land on the loader's device and train there.
    for dev in common::devices() {
        let loader = DataLoader::new(dataset(), 5, &dev).unwrap();
        for b in loader.epoch(0).unwrap() {
            let b = b.unwrap();
            assert!(b[0].device().same(&dev));
            let s = b[0].sum(&[], false).unwrap().item::<f32>().unwrap();
            assert!(s > 0.0);
        }
    }
}

/// A dataset computed on demand, whose sample 6 has the wrong shape.
struct Squares {
    broken: bool,
}

impl Dataset for Squares {
    fn len(&self) -> usize {
        8
    }

    fn get(&self, index: usize) -> Result<Vec<HostArray>> {
        let n = if self.broken && index == 6 { 2 } else { 1 };
        Ok(vec![HostArray::from_slice(&vec![(index * index) as f32; n], &[n])?])
    }
}

#[test]
fn custom_datasets_collate_and_report_errors() {
    let dev = Device::cpu();
    let loader = DataLoader::new(Squares { broken: false }, 3, &dev).unwrap();
    let first = loader.epoch(0).unwrap().next().unwrap().unwrap();
    assert_eq!(first[0].dims(), [3, 1]);
    assert_eq!(first[0].to_vec::<f32>().unwrap(), [0.0, 1.0, 4.0]);
    // A sample of another shape ends the epoch with an error naming it.
    for prefetch in [0, 2] {
        let loader = DataLoader::new(Squares { broken: true }, 3, &dev).unwrap().prefetch(prefetch);
        let got: Vec<_> = loader.epoch(0).unwrap().collect();
        assert_eq!(got.len(), 3, "two good batches, then the error");
        let e = got[2].as_ref().unwrap_err().to_string();
        assert!(e.contains("field 0 of sample 7 is f32[1], of sample 6"), "{e}");
        assert!(e.contains("[2]"), "{e}");
    }
}

#[test]
fn bad_configurations_are_errors() {
    let dev = Device::cpu();
    let e = DataLoader::new(dataset(), 0, &dev).unwrap_err().to_string();
    assert!(e.contains("batch_size") && e.contains("data_loader.rs"), "{e}");
    let huge = DataLoader::new(dataset(), 2, &dev).unwrap().prefetch(usize::MAX);
    let e = huge.epoch(0).unwrap_err().to_string();
    assert!(e.contains("prefetch") && e.contains("data_loader.rs"), "{e}");
    assert!(DataLoader::new(dataset(), 2, &dev).unwrap().prefetch(lazuli::data::MAX_PREFETCH).epoch(0).is_ok());
    let x = HostArray::from_slice(&[1.0f32; 6], &[3, 2]).unwrap();
    let y = HostArray::from_slice(&[1i32; 4], &[4]).unwrap();
    let e = TensorDataset::new(vec![x.clone(), y]).unwrap_err().to_string();
    assert!(e.contains("first dim 3") && e.contains("data_loader.rs"), "{e}");
    assert!(TensorDataset::new(vec![]).is_err());
    assert!(TensorDataset::new(vec![HostArray::from_slice(&[1.0f32], &[]).unwrap()]).is_err());
    assert!(HostArray::from_slice(&[1.0f32; 5], &[3, 2]).is_err());
    let empty = TensorDataset::new(vec![HostArray::from_slice::<f32>(&[], &[0, 2]).unwrap()]).unwrap();
    assert!(DataLoader::new(empty, 2, &dev).unwrap_err().to_string().contains("no samples"));
    let ds = TensorDataset::new(vec![x]).unwrap();
    assert!(ds.get(3).unwrap_err().to_string().contains("index 3"));
    assert!(ds.get_batch(&[0, 5]).is_err());
    // From tensors.
    let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap();
    assert_eq!(TensorDataset::from_tensors(&[&t]).unwrap().len(), 3);
}

/// Counts the samples read.
struct Counted(Arc<AtomicUsize>);

impl Dataset for Counted {
    fn len(&self) -> usize {
        40
    }

    fn get(&self, index: usize) -> Result<Vec<HostArray>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(vec![HostArray::from_slice(&[index as f32], &[1])?])
    }
}

/// Waits until `count` reaches `want` (or 10 s pass); its value then.
fn wait_for(count: &AtomicUsize, want: usize) -> usize {
    let start = Instant::now();
    while count.load(Ordering::SeqCst) < want && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    count.load(Ordering::SeqCst)
}

#[test]
fn the_next_batches_are_prepared_ahead_and_the_queue_is_bounded() {
    let dev = Device::cpu();
    for prefetch in [1usize, 3] {
        let count = Arc::new(AtomicUsize::new(0));
        let loader = DataLoader::new(Counted(count.clone()), 4, &dev).unwrap().prefetch(prefetch);
        let mut it = loader.epoch(0).unwrap();
        let first = it.next().unwrap().unwrap();
        assert_eq!(first[0].to_vec::<f32>().unwrap(), [0.0, 1.0, 2.0, 3.0]);
        // While the caller holds batch 1, the thread prepares `prefetch`
        // more, and no further: the queue is bounded.
        let want = 4 * (1 + prefetch);
        assert_eq!(wait_for(&count, want), want, "prefetch {prefetch}");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(count.load(Ordering::SeqCst), want, "prefetch {prefetch}: bounded");
        assert_eq!(it.count(), 9);
    }
    // Without prefetch nothing is read ahead.
    let count = Arc::new(AtomicUsize::new(0));
    let loader = DataLoader::new(Counted(count.clone()), 4, &dev).unwrap().prefetch(0);
    let mut it = loader.epoch(0).unwrap();
    it.next().unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(count.load(Ordering::SeqCst), 4);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Any configuration is an error or a loader whose epochs hold every
    /// sample at most once (exactly once without drop_last), in batches of
    /// the batch size but possibly the last, as many as `len()` says.
    #[test]
    fn any_configuration_batches_every_sample_once(
        n in 0usize..30,
        batch in 0usize..12,
        drop_last: bool,
        shuffle in proptest::option::of(0u64..4),
        prefetch in 0usize..4,
        epoch in 0u64..3,
    ) {
        let dev = Device::cpu();
        let ys: Vec<i32> = (0..n as i32).collect();
        let ds = TensorDataset::new(vec![HostArray::from_slice(&ys, &[n]).unwrap()]).unwrap();
        let loader = match DataLoader::new(ds, batch, &dev) {
            Ok(l) => l,
            Err(_) => {
                proptest::prop_assert!(n == 0 || batch == 0);
                return Ok(());
            }
        };
        let mut loader = loader.drop_last(drop_last).prefetch(prefetch);
        if let Some(seed) = shuffle {
            loader = loader.shuffle(seed);
        }
        let batches: Vec<Vec<i32>> =
            loader.epoch(epoch).unwrap().map(|b| b.unwrap()[0].to_vec::<i32>().unwrap()).collect();
        proptest::prop_assert_eq!(batches.len(), loader.len());
        for (i, b) in batches.iter().enumerate() {
            proptest::prop_assert!(b.len() == batch || (i + 1 == batches.len() && !drop_last && b.len() < batch));
        }
        let mut all: Vec<i32> = batches.concat();
        all.sort();
        all.dedup();
        proptest::prop_assert_eq!(all.len(), batches.iter().map(Vec::len).sum::<usize>(), "no sample twice");
        if !drop_last {
            proptest::prop_assert_eq!(all, ys);
        }
    }
}
