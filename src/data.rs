//! Data loading, as PyTorch's `torch.utils.data`: a [`Dataset`] of
//! samples (each a list of host arrays, e.g. an image and its label), a
//! [`TensorDataset`] over arrays whose first dim indexes the samples, and
//! a [`DataLoader`] that shuffles (seeded: the order of an epoch depends on
//! the seed and the epoch number only, so a resumed run sees the same
//! batches), batches (stacking each field along a new first dim), drops
//! or keeps a short last batch, and prepares the next batches on a
//! background thread while the caller's step runs (a bounded prefetch).
//!
//! Batches are host-data tensors on the loader's device: preparing one
//! gathers and copies bytes on the host only; the upload happens when the
//! step that uses it syncs. A bad configuration (batch size 0, an empty
//! dataset, samples whose fields disagree) is an error naming the call
//! and the caller's line, never a panic.

use crate::ir::ValueType;
use crate::{DType, Device, Element, ExecError, Result, Tensor};
use lazuli_executor::splitmix64;
use std::panic::Location;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The most batches a [`DataLoader`] prepares ahead: a bound on the host
/// memory the queue holds, and on the channel allocated for it.
pub const MAX_PREFETCH: usize = 256;

/// A host array: one field of a sample (`dims` without the batch dim) or
/// of a batch, as canonical little-endian bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostArray {
    /// The element type.
    pub dtype: DType,
    /// The dims.
    pub dims: Vec<usize>,
    /// `dims.iter().product()` elements of `dtype`.
    pub bytes: Vec<u8>,
}

impl HostArray {
    /// An array of `data` with `dims`; the lengths must agree.
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], dims: &[usize]) -> Result<HostArray> {
        let numel: usize = dims.iter().product();
        if data.len() != numel {
            let at = Location::caller();
            return Err(invalid("HostArray::from_slice", format!("{} values for dims {dims:?} (at {at})", data.len())));
        }
        let mut bytes = Vec::with_capacity(numel * T::DTYPE.size_bytes());
        for &v in data {
            v.write_bytes(&mut bytes);
        }
        Ok(HostArray { dtype: T::DTYPE, dims: dims.to_vec(), bytes })
    }

    /// Reads `t`'s values (a barrier).
    pub fn from_tensor(t: &Tensor) -> Result<HostArray> {
        Ok(HostArray { dtype: t.dtype(), dims: t.dims().to_vec(), bytes: t.to_bytes()? })
    }

    /// The array as a host-data tensor on `device` (no upload yet).
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_bytes(self.bytes.clone(), ValueType::new(self.dims.clone(), self.dtype), device)
    }
}

/// Samples by index, each a list of fields (PyTorch's map-style dataset).
/// `Send + Sync`, so a [`DataLoader`] can read it from its thread.
pub trait Dataset: Send + Sync {
    /// The number of samples.
    fn len(&self) -> usize;

    /// True with no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fields of sample `index` (below [`Dataset::len`]).
    fn get(&self, index: usize) -> Result<Vec<HostArray>>;

    /// The batch of the samples at `indices`: each field stacked along a
    /// new first dim (PyTorch's default collate). Every sample must have
    /// the same number of fields, each with the same dtype and dims.
    fn get_batch(&self, indices: &[usize]) -> Result<Vec<HostArray>> {
        let samples = indices.iter().map(|&i| self.get(i)).collect::<Result<Vec<_>>>()?;
        collate(indices, &samples)
    }
}

/// Stacks `samples` (of dataset indices `indices`) field by field along a
/// new first dim.
fn collate(indices: &[usize], samples: &[Vec<HostArray>]) -> Result<Vec<HostArray>> {
    let Some(first) = samples.first() else { return Ok(Vec::new()) };
    let mut out: Vec<HostArray> = first
        .iter()
        .map(|f| {
            let mut dims = vec![samples.len()];
            dims.extend(&f.dims);
            HostArray { dtype: f.dtype, dims, bytes: Vec::with_capacity(f.bytes.len() * samples.len()) }
        })
        .collect();
    for (&s, sample) in indices.iter().zip(samples) {
        let i0 = indices[0];
        if sample.len() != first.len() {
            let detail =
                format!("sample {s} has {} fields, sample {i0} (first of the batch) {}", sample.len(), first.len());
            return Err(invalid("Dataset::get_batch", detail));
        }
        for (k, (field, f0)) in sample.iter().zip(first).enumerate() {
            if field.dtype != f0.dtype || field.dims != f0.dims {
                let detail = format!(
                    "field {k} of sample {s} is {}{:?}, of sample {i0} (first of the batch) {}{:?}",
                    field.dtype, field.dims, f0.dtype, f0.dims
                );
                return Err(invalid("Dataset::get_batch", detail));
            }
            out[k].bytes.extend_from_slice(&field.bytes);
        }
    }
    Ok(out)
}

/// Samples as the rows of arrays that share their first dim (PyTorch's
/// `TensorDataset`): sample `i` is row `i` of every array.
#[derive(Clone, Debug)]
pub struct TensorDataset {
    fields: Vec<HostArray>,
    len: usize,
}

impl TensorDataset {
    /// A dataset over `fields`, each of rank 1 or more with the same first
    /// dim.
    #[track_caller]
    pub fn new(fields: Vec<HostArray>) -> Result<TensorDataset> {
        let at = Location::caller();
        let Some(first) = fields.first() else {
            return Err(invalid("TensorDataset::new", format!("no fields (at {at})")));
        };
        let Some(&len) = first.dims.first() else {
            return Err(invalid(
                "TensorDataset::new",
                format!("field 0 is a scalar; fields need a first dim (at {at})"),
            ));
        };
        for (k, f) in fields.iter().enumerate() {
            let numel: usize = f.dims.iter().product();
            if f.dims.first() != Some(&len) || f.bytes.len() != numel * f.dtype.size_bytes() {
                let detail = format!(
                    "field {k} is {}{:?} with {} bytes; every field needs first dim {len} (at {at})",
                    f.dtype,
                    f.dims,
                    f.bytes.len()
                );
                return Err(invalid("TensorDataset::new", detail));
            }
        }
        Ok(TensorDataset { fields, len })
    }

    /// A dataset over tensors' values (read once: a barrier).
    #[track_caller]
    pub fn from_tensors(tensors: &[&Tensor]) -> Result<TensorDataset> {
        TensorDataset::new(tensors.iter().map(|t| HostArray::from_tensor(t)).collect::<Result<_>>()?)
    }

    fn check(&self, index: usize) -> Result<()> {
        if index >= self.len {
            return Err(invalid("TensorDataset::get", format!("index {index} out of range for {} samples", self.len)));
        }
        Ok(())
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Vec<HostArray>> {
        self.check(index)?;
        Ok(self
            .fields
            .iter()
            .map(|f| {
                let row = f.bytes.len() / self.len;
                HostArray { dtype: f.dtype, dims: f.dims[1..].to_vec(), bytes: f.bytes[index * row..][..row].to_vec() }
            })
            .collect())
    }

    /// Gathers rows straight into the batch (the same result as stacking
    /// [`Dataset::get`]).
    fn get_batch(&self, indices: &[usize]) -> Result<Vec<HostArray>> {
        for &i in indices {
            self.check(i)?;
        }
        Ok(self
            .fields
            .iter()
            .map(|f| {
                let row = f.bytes.len() / self.len;
                let mut bytes = Vec::with_capacity(row * indices.len());
                for &i in indices {
                    bytes.extend_from_slice(&f.bytes[i * row..][..row]);
                }
                let mut dims = f.dims.clone();
                dims[0] = indices.len();
                HostArray { dtype: f.dtype, dims, bytes }
            })
            .collect())
    }
}

/// Batches of a [`Dataset`] on a device (see the module doc).
///
/// ```no_run
/// # use lazuli::prelude::*;
/// # use lazuli::data::{DataLoader, HostArray, TensorDataset};
/// # fn main() -> lazuli::Result<()> {
/// # let dev = Device::cpu();
/// let xs = HostArray::from_slice(&[0.0f32; 100 * 8], &[100, 8])?;
/// let ys = HostArray::from_slice(&[0i32; 100], &[100])?;
/// let loader = DataLoader::new(TensorDataset::new(vec![xs, ys])?, 16, &dev)?.shuffle(42).drop_last(true);
/// for epoch in 0..3 {
///     for batch in loader.epoch(epoch)? {
///         let batch = batch?; // [x: [16, 8], y: [16]]
///         // forward, backward, step, dev.mark_step() ...
///     }
/// }
/// # Ok(()) }
/// ```
pub struct DataLoader<D: Dataset + 'static> {
    dataset: Arc<D>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
    prefetch: usize,
    device: Device,
}

impl<D: Dataset + 'static> std::fmt::Debug for DataLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("samples", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("shuffle", &self.shuffle)
            .field("drop_last", &self.drop_last)
            .field("prefetch", &self.prefetch)
            .finish()
    }
}

impl<D: Dataset + 'static> DataLoader<D> {
    /// Batches of `batch_size` samples of `dataset` in order, the last one
    /// shorter if the size does not divide, two batches prepared ahead on
    /// a background thread. A batch size of 0 or an empty dataset is an
    /// error.
    #[track_caller]
    pub fn new(dataset: D, batch_size: usize, device: &Device) -> Result<DataLoader<D>> {
        let at = Location::caller();
        if batch_size == 0 {
            return Err(invalid("DataLoader::new", format!("batch_size must be at least 1, got 0 (at {at})")));
        }
        if dataset.is_empty() {
            return Err(invalid("DataLoader::new", format!("the dataset has no samples (at {at})")));
        }
        Ok(DataLoader {
            dataset: Arc::new(dataset),
            batch_size,
            shuffle: None,
            drop_last: false,
            prefetch: 2,
            device: device.clone(),
        })
    }

    /// Shuffles every epoch, by `seed` and the epoch number.
    pub fn shuffle(mut self, seed: u64) -> DataLoader<D> {
        self.shuffle = Some(seed);
        self
    }

    /// Drops the last batch when it would be shorter than the batch size.
    pub fn drop_last(mut self, drop_last: bool) -> DataLoader<D> {
        self.drop_last = drop_last;
        self
    }

    /// Batches prepared ahead on the background thread (0: each batch is
    /// prepared on the caller's thread when asked for, with no thread; at
    /// most [`MAX_PREFETCH`], or [`DataLoader::epoch`] is an error).
    pub fn prefetch(mut self, batches: usize) -> DataLoader<D> {
        self.prefetch = batches;
        self
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.dataset.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// True when an epoch has no batch (`drop_last` with fewer samples
    /// than the batch size).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample order of `epoch`: `0..len` without shuffling, else a
    /// permutation fixed by the seed and `epoch`.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        if let Some(seed) = self.shuffle {
            // Fisher-Yates over SplitMix64 seeded from (seed, epoch).
            let mut state = splitmix64(seed ^ splitmix64(epoch.wrapping_add(0x5EED)));
            for i in (1..order.len()).rev() {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let r = splitmix64(state);
                // Multiply-shift maps r to 0..=i without modulo bias worth
                // measuring at dataset sizes (below 2^32 samples).
                let j = ((u128::from(r) * (i as u128 + 1)) >> 64) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// The batches of epoch `epoch` (each a list of tensors, one per
    /// field), prepared ahead on a background thread. Dropping the
    /// iterator early stops the thread.
    #[track_caller]
    pub fn epoch(&self, epoch: u64) -> Result<Batches> {
        if self.prefetch > MAX_PREFETCH {
            let at = Location::caller();
            let detail = format!("prefetch of {} batches exceeds {MAX_PREFETCH} (at {at})", self.prefetch);
            return Err(invalid("DataLoader::epoch", detail));
        }
        let order = self.order(epoch);
        let mut batches: Vec<Vec<usize>> = order.chunks(self.batch_size).map(<[usize]>::to_vec).collect();
        if self.drop_last && batches.last().is_some_and(|b| b.len() < self.batch_size) {
            batches.pop();
        }
        let make = {
            let (dataset, device) = (self.dataset.clone(), self.device.clone());
            move |indices: &[usize]| -> Result<Vec<Tensor>> {
                dataset.get_batch(indices)?.iter().map(|a| a.to_tensor(&device)).collect()
            }
        };
        if self.prefetch == 0 {
            return Ok(Batches { inner: Inner::Inline { batches: batches.into_iter(), make: Box::new(make) } });
        }
        let (tx, rx) = sync_channel(self.prefetch - 1);
        let worker = std::thread::Builder::new()
            .name("lazuli-data".into())
            .spawn(move || {
                for indices in batches {
                    let b = make(&indices);
                    let failed = b.is_err();
                    // The receiver is gone: the caller dropped the iterator.
                    if tx.send(b).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| invalid("DataLoader::epoch", format!("cannot start the loader thread: {e}")))?;
        Ok(Batches { inner: Inner::Thread { rx: Some(rx), worker: Some(worker) } })
    }
}

/// The batches of one epoch, in order; an error ends the epoch.
pub struct Batches {
    inner: Inner,
}

/// Prepares a batch from its sample indices.
type MakeBatch = Box<dyn Fn(&[usize]) -> Result<Vec<Tensor>> + Send>;

enum Inner {
    Inline { batches: std::vec::IntoIter<Vec<usize>>, make: MakeBatch },
    Thread { rx: Option<Receiver<Result<Vec<Tensor>>>>, worker: Option<JoinHandle<()>> },
}

impl std::fmt::Debug for Batches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batches")
    }
}

impl Iterator for Batches {
    type Item = Result<Vec<Tensor>>;

    fn next(&mut self) -> Option<Result<Vec<Tensor>>> {
        match &mut self.inner {
            Inner::Inline { batches, make } => batches.next().map(|b| make(&b)),
            Inner::Thread { rx, worker } => {
                let got = rx.as_ref()?.recv().ok();
                if got.is_none() {
                    // The thread finished (or died): report a panic once.
                    *rx = None;
                    if let Some(w) = worker.take() {
                        if w.join().is_err() {
                            let detail = "the loader thread panicked (in the dataset's get or get_batch)".to_string();
                            return Some(Err(invalid("DataLoader", detail)));
                        }
                    }
                }
                got
            }
        }
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        if let Inner::Thread { rx, worker } = &mut self.inner {
            // Closing the channel makes the thread's next send fail.
            drop(rx.take());
            if let Some(w) = worker.take() {
                let _ = w.join();
            }
        }
    }
}

fn invalid(op: &str, detail: String) -> ExecError {
    ExecError::Invalid { op: op.into(), detail }
}
