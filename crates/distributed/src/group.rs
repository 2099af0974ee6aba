//! The process group: rank, world size, the node-local rank, and the
//! host-staged collectives every rank calls in the same order.
//!
//! Under MPI, one communication thread owned by the group makes every MPI
//! call (MPI is initialized there with `MPI_THREAD_FUNNELED`); callers
//! hand it jobs over a channel and wait for the result with a deadline
//! ([`DistOptions::timeout`]). A collective that misses its deadline is a
//! [`DistError::Timeout`] and leaves the group broken: its thread may
//! still sit in MPI, so the group then neither finalizes MPI nor runs
//! another collective, and when the process ends `mpirun` ends the job
//! ("exited without calling finalize"). Collectives started with
//! [`ProcessGroup::start_all_reduce_sum`] run while the caller goes on
//! (the next bucket's download), and are waited for where their result is
//! needed. A [`Link`] is a handle on the communication thread that a
//! device's registered collective holds (the all-reduces of recorded
//! steps); it shares the group's broken flag and fails once the group is
//! dropped.
//!
//! Without the `mpi` feature, or when the process was not launched by an
//! MPI launcher, the group has one rank and every collective returns its
//! input.

use crate::DistError;
use lazuli_executor::config::{self, Lookup};
use std::fmt::Display;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

/// Settings of a process group, from code or from `LAZULI_DIST_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DistOptions {
    /// How long a rank waits for one collective before it fails with
    /// [`DistError::Timeout`] (`LAZULI_DIST_TIMEOUT_SECS`, default 300 s).
    pub timeout: Duration,
    /// Gradient bytes per all-reduce bucket (`LAZULI_DIST_BUCKET_BYTES`,
    /// default 25 MiB); the first bucket stops at
    /// [`FIRST_BUCKET_BYTES`](crate::FIRST_BUCKET_BYTES) (1 MiB) when that
    /// is smaller, as in PyTorch's DDP.
    pub bucket_bytes: usize,
}

impl Default for DistOptions {
    fn default() -> Self {
        DistOptions { timeout: Duration::from_secs(300), bucket_bytes: 25 << 20 }
    }
}

impl DistOptions {
    /// The defaults overridden by the variables `lookup` gives (the
    /// process environment: [`config::process`]); a malformed value is an
    /// error naming it.
    pub fn resolve(lookup: Lookup<'_>) -> Result<DistOptions, DistError> {
        let mut o = DistOptions::default();
        if let Some(secs) = config::count(lookup, "LAZULI_DIST_TIMEOUT_SECS")? {
            o.timeout = Duration::from_secs(secs as u64);
        }
        if let Some(bytes) = config::bytes(lookup, "LAZULI_DIST_BUCKET_BYTES")? {
            o.bucket_bytes = usize::try_from(bytes).unwrap_or(usize::MAX).max(4);
        }
        Ok(o)
    }
}

/// How a group's ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// One process: collectives return their input.
    Local,
    /// MPI (rsmpi), every call on the group's communication thread.
    Mpi,
}

/// The processes of one job. Every rank must call the same collectives in
/// the same order.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_size: usize,
    options: DistOptions,
    broken: Arc<AtomicBool>,
    #[cfg(feature = "mpi")]
    comm: Option<mpi_thread::Comm>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("transport", &self.transport())
            .finish()
    }
}

/// The world size an MPI launcher announced in the environment, if any
/// (Open MPI's `OMPI_COMM_WORLD_SIZE`, PMI's `PMI_SIZE`, PMIx's
/// `PMIX_RANK` as a sign of a launch of unknown size).
fn launched_size() -> Option<usize> {
    let num = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<usize>().ok());
    num("OMPI_COMM_WORLD_SIZE").or_else(|| num("PMI_SIZE")).or_else(|| std::env::var_os("PMIX_RANK").map(|_| 0))
}

impl ProcessGroup {
    /// The group of this job: from MPI when an MPI launcher started the
    /// process (`mpirun`, `srun`), else a group of one. Options come from
    /// the environment ([`DistOptions::resolve`]).
    pub fn init() -> Result<ProcessGroup, DistError> {
        ProcessGroup::init_with(DistOptions::resolve(&config::process)?)
    }

    /// [`ProcessGroup::init`] with explicit options. MPI can be
    /// initialized once per process: a second MPI group is an error.
    pub fn init_with(options: DistOptions) -> Result<ProcessGroup, DistError> {
        match launched_size() {
            None => Ok(ProcessGroup::local(options)),
            Some(size) => ProcessGroup::mpi(options, size),
        }
    }

    /// A group of one process.
    pub fn local(options: DistOptions) -> ProcessGroup {
        ProcessGroup {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_size: 1,
            options,
            broken: Arc::new(AtomicBool::new(false)),
            #[cfg(feature = "mpi")]
            comm: None,
        }
    }

    #[cfg(feature = "mpi")]
    fn mpi(options: DistOptions, _announced: usize) -> Result<ProcessGroup, DistError> {
        let (comm, info) = mpi_thread::Comm::start(options.timeout)?;
        Ok(ProcessGroup {
            rank: info.rank,
            world_size: info.size,
            local_rank: info.local_rank,
            local_size: info.local_size,
            options,
            broken: Arc::new(AtomicBool::new(false)),
            comm: Some(comm),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(options: DistOptions, announced: usize) -> Result<ProcessGroup, DistError> {
        if announced > 1 {
            return Err(DistError::Init(format!(
                "launched by MPI with {announced} ranks, but built without the `mpi` feature: \
                 every rank would train alone"
            )));
        }
        Ok(ProcessGroup::local(options))
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This process's rank among the ranks of its machine (the index of
    /// the GPU it should use).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The number of ranks on this process's machine.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// The options in effect.
    pub fn options(&self) -> &DistOptions {
        &self.options
    }

    /// How the ranks talk.
    pub fn transport(&self) -> Transport {
        #[cfg(feature = "mpi")]
        if self.comm.is_some() {
            return Transport::Mpi;
        }
        Transport::Local
    }

    /// True after a timeout: the group runs no more collectives.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Every rank's `local` bytes, in rank order (lengths may differ).
    pub fn all_gather_bytes(&self, op: &'static str, local: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        self.check(op)?;
        #[cfg(feature = "mpi")]
        if let Some(comm) = &self.comm {
            let rx = comm.submit(op, |reply| mpi_thread::Job::AllGather { local: local.to_vec(), reply })?;
            return self.wait(op, rx);
        }
        Ok(vec![local.to_vec()])
    }

    /// Rank 0's `buf` on every rank; every rank passes a buffer of the same
    /// length (the others' contents are ignored).
    pub fn broadcast_bytes(&self, op: &'static str, buf: Vec<u8>) -> Result<Vec<u8>, DistError> {
        self.check(op)?;
        #[cfg(feature = "mpi")]
        if let Some(comm) = &self.comm {
            let rx = comm.submit(op, |reply| mpi_thread::Job::Broadcast { buf, reply })?;
            return self.wait(op, rx);
        }
        Ok(buf)
    }

    /// Starts the elementwise sum of every rank's `buf` (same length on
    /// every rank); the caller goes on and waits with
    /// [`PendingReduce::wait`].
    pub fn start_all_reduce_sum(&self, op: &'static str, buf: Vec<f32>) -> Result<PendingReduce<'_>, DistError> {
        self.check(op)?;
        #[cfg(feature = "mpi")]
        if let Some(comm) = &self.comm {
            let rx = comm.submit(op, |reply| mpi_thread::Job::AllReduce { buf, reply })?;
            return Ok(PendingReduce { group: self, op, state: Pending::Waiting(rx) });
        }
        Ok(PendingReduce { group: self, op, state: Pending::Ready(buf) })
    }

    /// The elementwise sum of every rank's `buf`, waited for.
    pub fn all_reduce_sum(&self, op: &'static str, buf: Vec<f32>) -> Result<Vec<f32>, DistError> {
        self.start_all_reduce_sum(op, buf)?.wait()
    }

    /// Makes every rank agree on whether each one succeeded: `Ok` when all
    /// did, else, on every rank, [`DistError::RankFailed`] naming the lowest
    /// failing rank and its error.
    pub fn agree<E: Display>(&self, op: &'static str, local: Result<(), E>) -> Result<(), DistError> {
        let message = match &local {
            Ok(()) => Vec::new(),
            Err(e) => {
                let text = e.to_string();
                if text.is_empty() { "failed".to_string() } else { text }.into_bytes()
            }
        };
        let all = self.all_gather_bytes(op, &message)?;
        match all.iter().position(|m| !m.is_empty()) {
            None => Ok(()),
            Some(rank) => Err(DistError::RankFailed {
                rank,
                world: self.world_size,
                op,
                message: String::from_utf8_lossy(&all[rank]).into_owned(),
            }),
        }
    }

    /// Waits until every rank arrives.
    pub fn barrier(&self) -> Result<(), DistError> {
        self.all_gather_bytes("barrier", &[]).map(drop)
    }

    fn check(&self, op: &'static str) -> Result<(), DistError> {
        if self.is_broken() {
            return Err(DistError::Broken { op });
        }
        Ok(())
    }

    fn wait<T>(&self, op: &'static str, rx: Receiver<T>) -> Result<T, DistError> {
        match rx.recv_timeout(self.options.timeout) {
            Ok(v) => Ok(v),
            Err(RecvTimeoutError::Timeout) => {
                self.broken.store(true, Ordering::Relaxed);
                Err(DistError::Timeout { op, timeout: self.options.timeout })
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.broken.store(true, Ordering::Relaxed);
                Err(DistError::Broken { op })
            }
        }
    }
}

impl ProcessGroup {
    /// A handle on this group's communication thread that outlives a
    /// borrow of the group (the device's registered collective holds one):
    /// it starts all-reduces and shares the group's broken flag; once the
    /// group is dropped it fails with [`DistError::Broken`].
    pub(crate) fn link(&self) -> Link {
        Link {
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.options.timeout,
            broken: self.broken.clone(),
            #[cfg(feature = "mpi")]
            jobs: self.comm.as_ref().map(|c| c.jobs.clone()),
        }
    }
}

/// See [`ProcessGroup::link`].
pub(crate) struct Link {
    pub rank: usize,
    pub world_size: usize,
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // only MPI collectives are waited for
    timeout: Duration,
    broken: Arc<AtomicBool>,
    #[cfg(feature = "mpi")]
    jobs: Option<Arc<std::sync::Mutex<Option<std::sync::mpsc::Sender<mpi_thread::Job>>>>>,
}

/// An all-reduce started through a [`Link`].
pub(crate) enum LinkPending {
    Ready(Vec<f32>),
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // only MPI collectives are waited for
    Waiting {
        rx: Receiver<(Vec<f32>, Duration)>,
        timeout: Duration,
        broken: Arc<AtomicBool>,
        op: &'static str,
    },
}

impl Link {
    /// Starts the sum of every rank's `buf` (as
    /// [`ProcessGroup::start_all_reduce_sum`]).
    pub fn start_sum(&self, op: &'static str, buf: Vec<f32>) -> Result<LinkPending, DistError> {
        if self.broken.load(Ordering::Relaxed) {
            return Err(DistError::Broken { op });
        }
        #[cfg(feature = "mpi")]
        if let Some(jobs) = &self.jobs {
            let rx = mpi_thread::submit(jobs, op, |reply| mpi_thread::Job::AllReduce { buf, reply })?;
            let (timeout, broken) = (self.timeout, self.broken.clone());
            return Ok(LinkPending::Waiting { rx, timeout, broken, op });
        }
        Ok(LinkPending::Ready(buf))
    }
}

impl LinkPending {
    /// The sum and the time the communication thread spent in MPI for it
    /// (zero for one process), bounded by the group's timeout.
    pub fn wait(self) -> Result<(Vec<f32>, Duration), DistError> {
        match self {
            LinkPending::Ready(v) => Ok((v, Duration::ZERO)),
            LinkPending::Waiting { rx, timeout, broken, op } => match rx.recv_timeout(timeout) {
                Ok(v) => Ok(v),
                Err(RecvTimeoutError::Timeout) => {
                    broken.store(true, Ordering::Relaxed);
                    Err(DistError::Timeout { op, timeout })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    broken.store(true, Ordering::Relaxed);
                    Err(DistError::Broken { op })
                }
            },
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm.take() {
            comm.finish(!self.is_broken(), self.options.timeout);
        }
    }
}

enum Pending {
    Ready(Vec<f32>),
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))] // only MPI collectives are waited for
    Waiting(Receiver<(Vec<f32>, Duration)>),
}

/// An all-reduce in flight.
pub struct PendingReduce<'a> {
    group: &'a ProcessGroup,
    op: &'static str,
    state: Pending,
}

impl PendingReduce<'_> {
    /// The sum, once every rank contributed (bounded by the group's
    /// timeout).
    pub fn wait(self) -> Result<Vec<f32>, DistError> {
        match self.state {
            Pending::Ready(v) => Ok(v),
            Pending::Waiting(rx) => self.group.wait(self.op, rx).map(|(v, _)| v),
        }
    }
}

#[cfg(feature = "mpi")]
mod mpi_thread {
    //! The communication thread: initializes MPI, answers jobs in order,
    //! finalizes MPI when the group is dropped.

    use crate::DistError;
    use mpi::collective::SystemOperation;
    use mpi::traits::*;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::Duration;

    pub(super) struct Info {
        pub rank: usize,
        pub size: usize,
        pub local_rank: usize,
        pub local_size: usize,
    }

    pub(super) enum Job {
        AllGather { local: Vec<u8>, reply: Sender<Vec<Vec<u8>>> },
        Broadcast { buf: Vec<u8>, reply: Sender<Vec<u8>> },
        AllReduce { buf: Vec<f32>, reply: Sender<(Vec<f32>, Duration)> },
    }

    pub(super) struct Comm {
        /// Shared with the group's [`super::Link`]s; taken (closing the
        /// channel) when the group ends.
        pub jobs: Arc<Mutex<Option<Sender<Job>>>>,
        done: Receiver<()>,
        thread: JoinHandle<()>,
    }

    impl Comm {
        pub fn start(timeout: Duration) -> Result<(Comm, Info), DistError> {
            let (jobs, job_rx) = channel::<Job>();
            let (info_tx, info_rx) = channel::<Result<Info, String>>();
            let (done_tx, done) = channel::<()>();
            let thread = std::thread::Builder::new()
                .name("lazuli-mpi".into())
                .spawn(move || serve(job_rx, info_tx, done_tx))
                .map_err(|e| DistError::Init(format!("cannot start the communication thread: {e}")))?;
            let info = match info_rx.recv_timeout(timeout) {
                Ok(Ok(info)) => info,
                Ok(Err(e)) => return Err(DistError::Init(e)),
                Err(_) => {
                    return Err(DistError::Init(format!("MPI_Init did not finish within {} s", timeout.as_secs())))
                }
            };
            Ok((Comm { jobs: Arc::new(Mutex::new(Some(jobs))), done, thread }, info))
        }

        pub fn submit<T>(
            &self,
            op: &'static str,
            job: impl FnOnce(Sender<T>) -> Job,
        ) -> Result<Receiver<T>, DistError> {
            submit(&self.jobs, op, job)
        }

        /// Ends the thread: when the group is sound, waits (bounded) for
        /// MPI_Finalize; a broken group's thread may be stuck in MPI and is
        /// left behind.
        pub fn finish(self, sound: bool, timeout: Duration) {
            let Comm { jobs, done, thread } = self;
            jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
            if sound && done.recv_timeout(timeout).is_ok() {
                let _ = thread.join();
            }
        }
    }

    /// Hands `job` to the communication thread; the reply comes on the
    /// returned receiver.
    pub(super) fn submit<T>(
        jobs: &Mutex<Option<Sender<Job>>>,
        op: &'static str,
        job: impl FnOnce(Sender<T>) -> Job,
    ) -> Result<Receiver<T>, DistError> {
        let (tx, rx) = channel();
        let jobs = jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.as_ref().ok_or(DistError::Broken { op })?.send(job(tx)).map_err(|_| DistError::Broken { op })?;
        Ok(rx)
    }

    fn serve(jobs: Receiver<Job>, info: Sender<Result<Info, String>>, done: Sender<()>) {
        let Some((universe, _level)) = mpi::initialize_with_threading(mpi::Threading::Funneled) else {
            let _ = info.send(Err("MPI is already initialized in this process (one group per process)".into()));
            return;
        };
        {
            let world = universe.world();
            let node = world.split_shared(world.rank());
            let _ = info.send(Ok(Info {
                rank: world.rank() as usize,
                size: world.size() as usize,
                local_rank: node.rank() as usize,
                local_size: node.size() as usize,
            }));
            // A reply nobody waits for any more (the caller timed out) is
            // dropped.
            for job in jobs {
                match job {
                    Job::AllGather { local, reply } => {
                        let _ = reply.send(all_gather(&world, &local));
                    }
                    Job::Broadcast { mut buf, reply } => {
                        world.process_at_rank(0).broadcast_into(&mut buf[..]);
                        let _ = reply.send(buf);
                    }
                    Job::AllReduce { buf, reply } => {
                        let started = std::time::Instant::now();
                        let mut sum = vec![0f32; buf.len()];
                        world.all_reduce_into(&buf[..], &mut sum[..], SystemOperation::sum());
                        let _ = reply.send((sum, started.elapsed()));
                    }
                }
            }
        }
        drop(universe);
        let _ = done.send(());
    }

    fn all_gather(world: &mpi::topology::SimpleCommunicator, local: &[u8]) -> Vec<Vec<u8>> {
        let size = world.size() as usize;
        let mut lens = vec![0u64; size];
        world.all_gather_into(&(local.len() as u64), &mut lens[..]);
        let width = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = local.to_vec();
        padded.resize(width, 0);
        let mut all = vec![0u8; width * size];
        if width > 0 {
            world.all_gather_into(&padded[..], &mut all[..]);
        }
        lens.iter().enumerate().map(|(r, &n)| all[r * width..r * width + n as usize].to_vec()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_the_variables_and_a_malformed_one_is_named() {
        fn set(name: &str) -> Option<String> {
            match name {
                "LAZULI_DIST_TIMEOUT_SECS" => Some("7".into()),
                "LAZULI_DIST_BUCKET_BYTES" => Some("1048576".into()),
                _ => None,
            }
        }
        let o = DistOptions::resolve(&set).unwrap();
        assert_eq!((o.timeout, o.bucket_bytes), (Duration::from_secs(7), 1 << 20));
        assert_eq!(DistOptions::resolve(&|_: &str| None).unwrap(), DistOptions::default());
        let zero = |name: &str| (name == "LAZULI_DIST_TIMEOUT_SECS").then(|| "0".to_string());
        let err = DistOptions::resolve(&zero).unwrap_err();
        let DistError::Config(e) = &err else { panic!("{err:?}") };
        assert_eq!((e.variable.as_str(), e.value.as_str()), ("LAZULI_DIST_TIMEOUT_SECS", "0"));
    }

    #[test]
    fn a_local_group_returns_its_inputs() {
        let g = ProcessGroup::local(DistOptions::default());
        assert_eq!((g.rank(), g.world_size(), g.local_rank(), g.local_size()), (0, 1, 0, 1));
        assert_eq!(g.transport(), Transport::Local);
        assert_eq!(g.broadcast_bytes("test", vec![1, 2]).unwrap(), vec![1, 2]);
        assert_eq!(g.all_reduce_sum("test", vec![0.5]).unwrap(), vec![0.5]);
        g.agree("test", Ok::<(), String>(())).unwrap();
        g.barrier().unwrap();
    }
}
