//! Fault injection for tests: make a device's next executions fail or run
//! slowly, to prove that asynchronous errors surface at barriers and that
//! `sync` returns before the device is done. Per device, so parallel tests
//! do not disturb each other.

use crate::{BackendError, ExecError, Result};
use std::sync::Mutex;
use std::time::Duration;

/// Pending faults of one device.
#[derive(Default, Debug)]
pub(crate) struct Faults {
    pub fail_next: usize,
    pub panic_next: bool,
    pub delay: Option<Duration>,
}

pub(crate) fn before_execute(faults: &Mutex<Faults>, context: &str) -> Result<()> {
    let delay = {
        let mut f = faults.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::take(&mut f.panic_next) {
            drop(f);
            panic!("injected backend panic");
        }
        if f.fail_next > 0 {
            f.fail_next -= 1;
            return Err(ExecError::Backend {
                context: context.to_string(),
                source: BackendError::Device {
                    device: "fault injection".into(),
                    message: "injected device failure".into(),
                },
            });
        }
        f.delay
    };
    if let Some(d) = delay {
        std::thread::sleep(d);
    }
    Ok(())
}
