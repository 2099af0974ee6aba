//! Which source line a recorded op is attributed to. Every op method is
//! `#[track_caller]`, so an op records the line of the program that called
//! it; a library routine that records many ops through helpers and
//! closures (backward, an optimizer's step, a layer's forward) enters a
//! [`CallSite`] with its caller's location instead, and every op recorded
//! while it lives on this thread is attributed to that line. The
//! outermost site wins, so a routine called by another keeps the user's
//! line. Errors, warnings, the recompile explainer and validation reports
//! name these lines.

use std::cell::Cell;
use std::panic::Location;

thread_local! {
    static SITE: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
}

/// While alive, ops recorded on this thread are attributed to its location
/// (unless an outer `CallSite` is alive: the outermost wins). For library
/// code built on the engine; a program never needs one.
#[must_use = "the site lasts while the guard lives"]
pub struct CallSite {
    entered: bool,
}

impl CallSite {
    /// Attributes the ops recorded until the guard drops to `location`
    /// (usually `Location::caller()` of a `#[track_caller]` routine).
    pub fn enter(location: &'static Location<'static>) -> CallSite {
        let entered = SITE.with(|s| {
            if s.get().is_some() {
                return false;
            }
            s.set(Some(location));
            true
        });
        CallSite { entered }
    }

    /// The location ops are attributed to now, if a site is entered.
    pub fn current() -> Option<&'static Location<'static>> {
        SITE.with(Cell::get)
    }
}

impl Drop for CallSite {
    fn drop(&mut self) {
        if self.entered {
            SITE.with(|s| s.set(None));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outermost_site_wins_and_ends_with_its_guard() {
        let outer = Location::caller();
        assert_eq!(CallSite::current(), None);
        {
            let _a = CallSite::enter(outer);
            {
                let _b = CallSite::enter(Location::caller());
                assert_eq!(CallSite::current(), Some(outer));
            }
            assert_eq!(CallSite::current(), Some(outer));
        }
        assert_eq!(CallSite::current(), None);
    }
}
