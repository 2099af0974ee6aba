//! Warnings about the user's program (a loop that never marks its step, a
//! sync point that compiles anew every time, an i64 result on a device
//! whose kernels have none): each goes through `tracing` at warn level,
//! target `lazuli`, and, when the program has installed no `tracing`
//! subscriber, is printed once to stderr as `lazuli: warning: ...`.
//!
//! Why both: a library must not install a global subscriber (that is the
//! program's choice, and a second `set_global_default` fails), yet a
//! warning nobody sees is the silent trap it exists to prevent, and most
//! small programs install no subscriber. So the event always goes to
//! `tracing` (a program with a subscriber filters, formats and routes it
//! as it likes, and nothing is printed beside it), and only where the
//! current dispatcher is `tracing`'s no-op one does this module print the
//! same text itself. `LAZULI_WARNINGS=0` turns that printing off.
//!
//! Each warning is given once per key (a cause at a source line), so a
//! loop of a million iterations prints one line. Every warning given is
//! also kept ([`given`]) and appended to the metrics report's notes.

use std::collections::HashSet;
use std::sync::Mutex;

static GIVEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
static KEYS: Mutex<Option<HashSet<String>>> = Mutex::new(None);

/// Gives the warning `message` once per process for `key` (see the
/// module docs): `true` if it was given now, `false` if `key` had been
/// warned about before.
pub fn once(key: &str, message: &str) -> bool {
    {
        let mut keys = KEYS.lock().unwrap_or_else(|e| e.into_inner());
        if !keys.get_or_insert_with(HashSet::new).insert(key.to_string()) {
            return false;
        }
    }
    give(message);
    true
}

/// Gives the warning `message` now (see the module docs).
pub fn give(message: &str) {
    tracing::warn!(target: "lazuli", "{message}");
    if no_subscriber() && printing_on() {
        eprintln!("lazuli: warning: {message}");
    }
    crate::metrics::note(format!("warning: {message}"));
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if given.len() >= 256 {
        given.remove(0);
    }
    given.push(message.to_string());
}

/// Every warning given in this process so far (the last 256), oldest
/// first: what a test or a tool asserts on without capturing stderr.
pub fn given() -> Vec<String> {
    GIVEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// True when no `tracing` subscriber is installed for this thread (none
/// set as the global default, none set as this thread's default).
fn no_subscriber() -> bool {
    tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>())
}

/// `LAZULI_WARNINGS`, read once (a malformed value keeps the default, on:
/// `Device::new` reports it).
fn printing_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::config::flag(&crate::config::process, "LAZULI_WARNINGS").ok().flatten().unwrap_or(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_warns_once() {
        assert!(once("warn-test-key", "first"));
        assert!(!once("warn-test-key", "second"));
        let given = given();
        assert!(given.iter().any(|m| m == "first"));
        assert!(!given.iter().any(|m| m == "second"));
    }

    #[test]
    fn no_subscriber_is_detected() {
        assert!(no_subscriber(), "the unit tests install no subscriber");
    }
}
